/* The router's prefix index, natively: prompts' block keys, and each worker's keys.
 *
 * The same two things keystore.py implements in Python (the reference, and what runs
 * where this module was not built); tests/router/test_keystore.py holds them equal.
 * A decision hashes a prompt and walks each worker's keys once: in Python that is a
 * dozen numpy calls and ~100 dict and set lookups, which a router idle between
 * requests pays with cold caches (bench/README.md, "The router's placement").
 *
 *   block_keys(token_ids, block_size, parent=0) -> bytes
 *       The keys of the full blocks, native-endian uint64s (at most 2**14 of them):
 *       key_i = key_{i-1} * M + sum_j t_{i*B+j} * M**(j+1)  (mod 2**64),
 *       key_-1 = parent (0: the blocks start the prompt).
 *   KeyStore()
 *       One worker's keys, each with the time until which it counts (inf: reported
 *       by the engine; finite: placed there provisionally).
 *       .match(keys, now) -> int     leading keys held (until > now)
 *       .place(keys, start, until)   keys[start:] not reported: held until `until`
 *       .confirm(key)                reported by the engine: held for good
 *       .drop(key)                   evicted
 *       .expire(now)                 forget provisional keys whose time is up
 *       len(store)                   keys held (provisional ones included)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MULT 0x9E3779B97F4A7C15ULL
#define MAX_BLOCKS (1 << 14)
#define PREFETCH 8          /* keys looked up ahead in match() */

/* ---- block keys ---------------------------------------------------------------- */

/* A buffer's item format as one integer format character ('b' ... 'Q'), byte order
 * prefix dropped; 0 for any other format. */
static char
int_format(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    return f[0] && !f[1] && strchr("bBhHiIlLqQ", f[0]) ? f[0] : 0;
}

/* An int argument as a uint64 key (mod 2**64); -1 with an exception set if not an int. */
static int
key_arg(PyObject *arg, uint64_t *key)
{
    *key = PyLong_AsUnsignedLongLongMask(arg);
    return *key == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Token ids as uint64s, from a buffer (bytes, array, numpy), a list or tuple, an object
 * with __array__ (protobuf's repeated fields), or any sequence. */
static uint64_t *
token_ids(PyObject *obj, Py_ssize_t *count)
{
    uint64_t *out = NULL;
    PyObject *arr = NULL;
    Py_buffer view;
    if (!PyObject_CheckBuffer(obj) && !PyList_Check(obj) && !PyTuple_Check(obj)
            && PyObject_HasAttrString(obj, "__array__")) {
        arr = PyObject_CallMethod(obj, "__array__", NULL);
        if (arr == NULL)
            return NULL;
        obj = arr;
    }
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        char f = int_format(&view);
        if (!f) {
            PyErr_Format(PyExc_TypeError, "token ids must be integers, not format '%s'",
                         view.format ? view.format : "B");
            PyBuffer_Release(&view);
            goto done;
        }
        int sign = (f == 'b' || f == 'h' || f == 'i' || f == 'l' || f == 'q');
        Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
        out = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
        if (out == NULL) {
            PyErr_NoMemory();
        } else if (view.itemsize == 8) {
            memcpy(out, view.buf, n * 8);
        } else if (view.itemsize == 4) {
            for (Py_ssize_t i = 0; i < n; i++)
                out[i] = sign ? (uint64_t)(int64_t)((int32_t *)view.buf)[i]
                              : ((uint32_t *)view.buf)[i];
        } else if (view.itemsize == 2) {
            for (Py_ssize_t i = 0; i < n; i++)
                out[i] = sign ? (uint64_t)(int64_t)((int16_t *)view.buf)[i]
                              : ((uint16_t *)view.buf)[i];
        } else if (view.itemsize == 1) {
            for (Py_ssize_t i = 0; i < n; i++)
                out[i] = sign ? (uint64_t)(int64_t)((int8_t *)view.buf)[i]
                              : ((uint8_t *)view.buf)[i];
        } else {
            PyErr_Format(PyExc_TypeError, "token ids of %zd bytes each", view.itemsize);
            PyMem_Free(out);
            out = NULL;
        }
        *count = n;
        PyBuffer_Release(&view);
        goto done;
    }
    PyObject *seq = PySequence_Fast(obj, "token ids must be a sequence of ints");
    if (seq == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    out = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    if (out == NULL) {
        PyErr_NoMemory();
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            out[i] = PyLong_AsUnsignedLongLongMask(items[i]);
            if (out[i] == (uint64_t)-1 && PyErr_Occurred()) {
                PyMem_Free(out);
                out = NULL;
                break;
            }
        }
    }
    *count = n;
    Py_DECREF(seq);
done:
    Py_XDECREF(arr);
    return out;
}

static PyObject *
block_keys(PyObject *module, PyObject *args)
{
    PyObject *obj, *parent_obj = NULL;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "On|O:block_keys", &obj, &block, &parent_obj))
        return NULL;
    uint64_t parent = 0;
    if (parent_obj != NULL && key_arg(parent_obj, &parent) < 0)
        return NULL;
    if (block <= 0 || block > 4096) {
        PyErr_Format(PyExc_ValueError, "block_size must be 1..4096, got %zd", block);
        return NULL;
    }
    Py_ssize_t count = 0;
    uint64_t *ids = token_ids(obj, &count);
    if (ids == NULL)
        return NULL;
    Py_ssize_t n = count / block;
    if (n > MAX_BLOCKS)
        n = MAX_BLOCKS;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL) {
        uint64_t w[4096];
        uint64_t p = MULT;
        for (Py_ssize_t j = 0; j < block; j++, p *= MULT)
            w[j] = p;
        uint64_t *keys = (uint64_t *)PyBytes_AS_STRING(out);
        uint64_t key = parent;
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t *t = ids + i * block;
            uint64_t content = 0;
            for (Py_ssize_t j = 0; j < block; j++)
                content += t[j] * w[j];
            key = key * MULT + content;
            keys[i] = key;
        }
    }
    PyMem_Free(ids);
    return out;
}

/* ---- one worker's keys: open addressing, linear probing, backward-shift deletion ---- */

typedef struct {
    uint64_t key;
    double until;           /* 0: empty slot (a held key's until is > 0) */
} Slot;

typedef struct {
    uint64_t key;
    double until;
} Placed;                   /* the provisional keys, oldest first (a ring) */

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;            /* capacity - 1, capacity a power of two */
    size_t used;
    Placed *ring;
    size_t ring_cap, ring_head, ring_len;
} KeyStore;

static inline size_t
home(uint64_t key, size_t mask)
{
    return (size_t)((key * 0xFF51AFD7ED558CCDULL) >> 32) & mask;
}

static Slot *
find(KeyStore *s, uint64_t key)
{
    for (size_t i = home(key, s->mask);; i = (i + 1) & s->mask) {
        Slot *slot = &s->slots[i];
        if (slot->until == 0 || slot->key == key)
            return slot;
    }
}

static int
grow(KeyStore *s)
{
    size_t cap = (s->mask + 1) * 2;
    Slot *old = s->slots, *slots = PyMem_Calloc(cap, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t old_cap = s->mask + 1;
    s->slots = slots;
    s->mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].until != 0)
            *find(s, old[i].key) = old[i];
    PyMem_Free(old);
    return 0;
}

/* Set key's until; -1 on memory error. */
static int
put(KeyStore *s, uint64_t key, double until)
{
    Slot *slot = find(s, key);
    if (slot->until == 0) {
        if ((s->used + 1) * 2 > s->mask + 1) {
            if (grow(s) < 0)
                return -1;
            slot = find(s, key);
        }
        slot->key = key;
        s->used++;
    }
    slot->until = until;
    return 0;
}

static void
delete(KeyStore *s, Slot *slot)
{
    size_t i = slot - s->slots;
    for (size_t j = (i + 1) & s->mask;; j = (j + 1) & s->mask) {
        Slot *next = &s->slots[j];
        if (next->until == 0)
            break;
        size_t h = home(next->key, s->mask);
        /* next moves to the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            s->slots[i] = *next;
            i = j;
        }
    }
    s->slots[i].until = 0;
    s->slots[i].key = 0;
    s->used--;
}

static int
ring_push(KeyStore *s, uint64_t key, double until)
{
    if (s->ring_len == s->ring_cap) {
        size_t cap = s->ring_cap ? s->ring_cap * 2 : 64;
        Placed *ring = PyMem_Malloc(cap * sizeof(Placed));
        if (ring == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < s->ring_len; i++)
            ring[i] = s->ring[(s->ring_head + i) % s->ring_cap];
        PyMem_Free(s->ring);
        s->ring = ring;
        s->ring_cap = cap;
        s->ring_head = 0;
    }
    s->ring[(s->ring_head + s->ring_len) % s->ring_cap] = (Placed){key, until};
    s->ring_len++;
    return 0;
}

/* Keys as uint64s: a buffer of them (what block_keys returns), or a sequence of ints. */
typedef struct {
    const uint64_t *p;
    Py_ssize_t n;
    Py_buffer view;
    uint64_t *owned;
} Keys;

static int
keys_of(PyObject *obj, Keys *k)
{
    k->owned = NULL;
    k->view.obj = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &k->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        char f = int_format(&k->view);
        /* 64-bit ints as they are, or raw bytes (block_keys' own output)... */
        int wide = k->view.itemsize == 8 && f && strchr("qQlL", f);
        int raw = k->view.itemsize == 1 && f == 'B' && k->view.len % 8 == 0;
        if (wide || raw) {
            k->p = k->view.buf;
            k->n = k->view.len / 8;
            return 0;
        }
        PyBuffer_Release(&k->view);       /* ...else read as ints of their own width */
        k->view.obj = NULL;
    }
    k->owned = token_ids(obj, &k->n);
    k->p = k->owned;
    return k->owned == NULL ? -1 : 0;
}

static void
keys_release(Keys *k)
{
    if (k->owned != NULL)
        PyMem_Free(k->owned);
    else if (k->view.obj != NULL)
        PyBuffer_Release(&k->view);
}

static PyObject *
KeyStore_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyStore() takes no arguments");
        return NULL;
    }
    KeyStore *s = (KeyStore *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    s->slots = PyMem_Calloc(64, sizeof(Slot));
    if (s->slots == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    s->mask = 63;
    return (PyObject *)s;
}

static void
KeyStore_dealloc(KeyStore *s)
{
    PyMem_Free(s->slots);
    PyMem_Free(s->ring);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
KeyStore_match(KeyStore *s, PyObject *args)
{
    PyObject *obj;
    double now;
    Keys k;
    if (!PyArg_ParseTuple(args, "Od:match", &obj, &now) || keys_of(obj, &k) < 0)
        return NULL;
    Py_ssize_t depth = 0;
    /* A router idle between requests meets its tables cold: ask for the slots a few
     * keys ahead while this one is checked, so that their misses overlap. */
    for (Py_ssize_t i = 0; i < k.n && i < PREFETCH; i++)
        __builtin_prefetch(&s->slots[home(k.p[i], s->mask)]);
    while (depth < k.n) {
        if (depth + PREFETCH < k.n)
            __builtin_prefetch(&s->slots[home(k.p[depth + PREFETCH], s->mask)]);
        Slot *slot = find(s, k.p[depth]);
        if (slot->until == 0 || slot->until <= now)
            break;
        depth++;
    }
    keys_release(&k);
    return PyLong_FromSsize_t(depth);
}

static PyObject *
KeyStore_place(KeyStore *s, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t start;
    double until;
    Keys k;
    if (!PyArg_ParseTuple(args, "Ond:place", &obj, &start, &until))
        return NULL;
    if (!(until > 0) || isinf(until)) {
        PyErr_SetString(PyExc_ValueError, "until must be a finite time > 0");
        return NULL;
    }
    if (keys_of(obj, &k) < 0)
        return NULL;
    int failed = 0;
    for (Py_ssize_t i = start < 0 ? 0 : start; i < k.n && !failed; i++) {
        Slot *slot = find(s, k.p[i]);
        if (slot->until != 0 && isinf(slot->until))
            continue;                               /* reported already */
        failed = put(s, k.p[i], until) < 0 || ring_push(s, k.p[i], until) < 0;
    }
    keys_release(&k);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyStore_confirm(KeyStore *s, PyObject *arg)
{
    uint64_t key;
    if (key_arg(arg, &key) < 0 || put(s, key, INFINITY) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
KeyStore_drop(KeyStore *s, PyObject *arg)
{
    uint64_t key;
    if (key_arg(arg, &key) < 0)
        return NULL;
    Slot *slot = find(s, key);
    if (slot->until != 0)
        delete(s, slot);
    Py_RETURN_NONE;
}

static PyObject *
KeyStore_expire(KeyStore *s, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    while (s->ring_len && s->ring[s->ring_head].until <= now) {
        Placed p = s->ring[s->ring_head];
        s->ring_head = (s->ring_head + 1) % s->ring_cap;
        s->ring_len--;
        Slot *slot = find(s, p.key);
        if (slot->until == p.until)     /* not placed again since, nor reported */
            delete(s, slot);
    }
    Py_RETURN_NONE;
}

static Py_ssize_t
KeyStore_len(KeyStore *s)
{
    return (Py_ssize_t)s->used;
}

static PyMethodDef KeyStore_methods[] = {
    {"match", (PyCFunction)KeyStore_match, METH_VARARGS,
     "match(keys, now) -> how many leading keys are held"},
    {"place", (PyCFunction)KeyStore_place, METH_VARARGS,
     "place(keys, start, until): keys[start:] held until `until` unless reported"},
    {"confirm", (PyCFunction)KeyStore_confirm, METH_O, "confirm(key): reported, held"},
    {"drop", (PyCFunction)KeyStore_drop, METH_O, "drop(key): no longer held"},
    {"expire", (PyCFunction)KeyStore_expire, METH_O,
     "expire(now): forget provisional keys whose time is up"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyStore_as_sequence = {.sq_length = (lenfunc)KeyStore_len};

static PyTypeObject KeyStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "services.router._keystore.KeyStore",
    .tp_doc = "One worker's block keys, reported or placed provisionally.",
    .tp_basicsize = sizeof(KeyStore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyStore_new,
    .tp_dealloc = (destructor)KeyStore_dealloc,
    .tp_methods = KeyStore_methods,
    .tp_as_sequence = &KeyStore_as_sequence,
};

static PyMethodDef module_methods[] = {
    {"block_keys", block_keys, METH_VARARGS,
     "block_keys(token_ids, block_size, parent=0) -> bytes of the full blocks' uint64 keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keystore",
    "The router's prefix index, natively (see keystore.py).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__keystore(void)
{
    if (PyType_Ready(&KeyStoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyStoreType);
    if (PyModule_AddObject(m, "KeyStore", (PyObject *)&KeyStoreType) < 0) {
        Py_DECREF(&KeyStoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
