/* Token ids to streamed text for byte-level BPE tokenizers, as `tokenizers`'
 * DecodeStream (skip_special_tokens=True) streams it, without a decode per step.
 *
 * DecodeStream.step decodes its window of ids again at every token (~0.8 us per
 * id here, ~5 us per event of six ids) and returns the new text once the window
 * no longer ends with U+FFFD. For a byte-level tokenizer that window decodes, by
 * its `decode`, to: the bytes of the model tokens, each run of them up to an
 * added token decoded lossily as UTF-8 on its own, then the added token's text
 * (special ones skipped). So the stream keeps only what it has not returned yet:
 * `text` (runs already closed by an added token) and `run` (the open run's
 * bytes), and returns `text + lossy(run)` as soon as that is not empty and does
 * not end with U+FFFD. The table (detokenizer.byte_table) holds, per id, the
 * model token's bytes, the added token's str, or None (special, or unknown).
 * detokenizer.py checks the table against the tokenizer's own decode, and
 * tests/edge/test_byte_text.py the streams against DecodeStream.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *table;            /* tuple: bytes | str | None per id */
    PyObject *text;             /* str: closed runs not returned yet */
    char *run;                  /* the open run's bytes */
    Py_ssize_t len, cap;
} ByteStream;

static int run_extend(ByteStream *s, const char *bytes, Py_ssize_t n) {
    if (s->len + n > s->cap) {
        Py_ssize_t cap = s->cap ? s->cap : 32;
        while (cap < s->len + n) cap *= 2;
        char *grown = PyMem_Realloc(s->run, cap);
        if (grown == NULL) { PyErr_NoMemory(); return -1; }
        s->run = grown;
        s->cap = cap;
    }
    memcpy(s->run + s->len, bytes, n);
    s->len += n;
    return 0;
}

/* text + lossy(run): the text the window adds past what was returned. */
static PyObject *pending(ByteStream *s) {
    PyObject *tail = PyUnicode_DecodeUTF8(s->run, s->len, "replace");
    if (tail == NULL || PyUnicode_GET_LENGTH(s->text) == 0) return tail;
    PyObject *all = PyUnicode_Concat(s->text, tail);
    Py_DECREF(tail);
    return all;
}

/* Take one id into the window: 1 if it changed the window's text, 0 if not
 * (skipped), -1 on error. */
static int take(ByteStream *s, Py_ssize_t id) {
    PyObject *entry = (id >= 0 && id < PyTuple_GET_SIZE(s->table))
                      ? PyTuple_GET_ITEM(s->table, id) : Py_None;
    if (entry == Py_None)
        return 0;
    if (PyBytes_Check(entry))
        return run_extend(s, PyBytes_AS_STRING(entry), PyBytes_GET_SIZE(entry)) < 0 ? -1 : 1;
    PyObject *closed = pending(s);      /* an added token: it closes the open run */
    if (closed == NULL) return -1;
    PyObject *text = PyUnicode_Concat(closed, entry);
    Py_DECREF(closed);
    if (text == NULL) return -1;
    Py_SETREF(s->text, text);
    s->len = 0;
    return 1;
}

/* The window's new text, if it is ready: returned (a new reference) and
 * forgotten; else "" (empty, or a character still forming). NULL on error. */
static PyObject *release(ByteStream *s) {
    PyObject *out = pending(s);
    if (out == NULL) return NULL;
    Py_ssize_t n = PyUnicode_GET_LENGTH(out);
    if (n == 0 || PyUnicode_READ_CHAR(out, n - 1) == 0xFFFD) {
        Py_DECREF(out);                 /* not yet: a character is still forming */
        return PyUnicode_New(0, 0);
    }
    PyObject *empty = PyUnicode_New(0, 0);
    if (empty == NULL) { Py_DECREF(out); return NULL; }
    Py_SETREF(s->text, empty);
    s->len = 0;
    return out;
}

static PyObject *ByteStream_add(ByteStream *s, PyObject *ids) {
    PyObject *seq = PySequence_Fast(ids, "ids must be a sequence of ints");
    if (seq == NULL) return NULL;
    PyObject *out = PyUnicode_New(0, 0);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), NULL);
        if (id == -1 && PyErr_Occurred()) { Py_CLEAR(out); break; }
        int changed = take(s, id);
        if (changed < 0) { Py_CLEAR(out); break; }
        if (!changed) continue;         /* skipped: the window decodes as before */
        PyObject *piece = release(s);
        if (piece == NULL) { Py_CLEAR(out); break; }
        if (PyUnicode_GET_LENGTH(piece)) PyUnicode_Append(&out, piece);
        Py_DECREF(piece);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *ByteStream_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"table", "prompt_ids", NULL};
    PyObject *table, *prompt;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", kwlist, &PyTuple_Type, &table, &prompt))
        return NULL;
    ByteStream *s = (ByteStream *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    Py_INCREF(table);
    s->table = table;
    s->text = PyUnicode_New(0, 0);
    if (s->text == NULL) { Py_DECREF(s); return NULL; }
    /* Primed as DecodeStream primes its prefix: the prompt's text is the prefix
     * unless it ends with U+FFFD; then it stays in the window, and comes out with
     * the first text that completes it. */
    PyObject *seq = PySequence_Fast(prompt, "prompt_ids must be a sequence of ints");
    if (seq == NULL) { Py_DECREF(s); return NULL; }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_ssize_t id = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), NULL);
        if ((id == -1 && PyErr_Occurred()) || take(s, id) < 0) {
            Py_DECREF(seq);
            Py_DECREF(s);
            return NULL;
        }
    }
    Py_DECREF(seq);
    PyObject *primed = release(s);
    if (primed == NULL) { Py_DECREF(s); return NULL; }
    Py_DECREF(primed);
    return (PyObject *)s;
}

static void ByteStream_dealloc(ByteStream *s) {
    Py_XDECREF(s->table);
    Py_XDECREF(s->text);
    PyMem_Free(s->run);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef ByteStream_methods[] = {
    {"add", (PyCFunction)ByteStream_add, METH_O,
     "add(ids) -> str: the text these ids release, as DecodeStream.step would, id by id"},
    {NULL}
};

static PyTypeObject ByteStreamType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve.services.edge._bytetext.ByteStream",
    .tp_basicsize = sizeof(ByteStream),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ByteStream(table, prompt_ids): one request's output text, fed token ids",
    .tp_new = ByteStream_new,
    .tp_dealloc = (destructor)ByteStream_dealloc,
    .tp_methods = ByteStream_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bytetext",
    "Byte-level BPE detokenizing in C (see detokenizer.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__bytetext(void) {
    if (PyType_Ready(&ByteStreamType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&ByteStreamType);
    if (PyModule_AddObject(m, "ByteStream", (PyObject *)&ByteStreamType) < 0) {
        Py_DECREF(&ByteStreamType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
