/* The router's placement, natively: prompts' block keys, each worker's keys and load,
 * and the decision itself.
 *
 * keystore.py, registry.py and placement.py hold the Python reference of each (what
 * runs where this module was not built); tests/router/test_keystore.py and
 * test_decide.py hold them equal. A router idle between requests meets a decision
 * with cold caches: on this VM code run right after a halted vCPU wakes is 3-20x
 * slower than back to back, in proportion to the memory it touches, and a decision in
 * Python touches a lot (docs/design/2026-12-05-placement-in-c.md).
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
 *   Worker()
 *       A worker's load as the router accounts it, in C fields (registry.WorkerEntry
 *       subclasses it): role, serving, last_seen, load, routed, load_pushed, model,
 *       worker_id (and its rendezvous seed), and the times of placements not yet in
 *       a load report (.placed(now), .clear_pending(), .decay(now, horizon), .pending).
 *   decide(workers, stores, knobs, model, exclude, prompt, prompt_tokens, block,
 *          session, now, timeout, horizon, index_now, ttl, salt_root, salt_at,
 *          salt_second)
 *       placement.py's decision over a placement.Query's fields, which c_decide
 *       passes (placement.py_decide is the reference); the prompt's keys are salted
 *       as keystore.salted_block_keys salts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
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

/* The keys of n full blocks of `block` ids each, chained from `parent`, into out[n]. */
static void
hash_blocks(const uint64_t *ids, Py_ssize_t n, Py_ssize_t block, uint64_t parent,
            uint64_t *out)
{
    uint64_t w[4096];
    uint64_t p = MULT;
    for (Py_ssize_t j = 0; j < block; j++, p *= MULT)
        w[j] = p;
    uint64_t key = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *t = ids + i * block;
        uint64_t content = 0;
        for (Py_ssize_t j = 0; j < block; j++)
            content += t[j] * w[j];
        key = key * MULT + content;
        out[i] = key;
    }
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
    if (out != NULL)
        hash_blocks(ids, n, block, parent, (uint64_t *)PyBytes_AS_STRING(out));
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

/* Double a full ring of `len` items of `size` bytes (64 at first), its oldest first at
 * index 0 after; -1 with MemoryError set if that fails. */
static int
ring_grow(void **ring, size_t *cap, size_t *head, size_t len, size_t size)
{
    size_t new_cap = *cap ? *cap * 2 : 64;
    char *grown = PyMem_Malloc(new_cap * size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < len; i++)
        memcpy(grown + i * size, (char *)*ring + ((*head + i) % *cap) * size, size);
    PyMem_Free(*ring);
    *ring = grown;
    *cap = new_cap;
    *head = 0;
    return 0;
}

static int
ring_push(KeyStore *s, uint64_t key, double until)
{
    if (s->ring_len == s->ring_cap
            && ring_grow((void **)&s->ring, &s->ring_cap, &s->ring_head, s->ring_len,
                         sizeof(Placed)) < 0)
        return -1;
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

/* How many leading keys are held at `now`. */
static Py_ssize_t
match_keys(KeyStore *s, const uint64_t *keys, Py_ssize_t n, double now)
{
    Py_ssize_t depth = 0;
    /* A router idle between requests meets its tables cold: ask for the slots a few
     * keys ahead while this one is checked, so that their misses overlap. */
    for (Py_ssize_t i = 0; i < n && i < PREFETCH; i++)
        __builtin_prefetch(&s->slots[home(keys[i], s->mask)]);
    while (depth < n) {
        if (depth + PREFETCH < n)
            __builtin_prefetch(&s->slots[home(keys[depth + PREFETCH], s->mask)]);
        Slot *slot = find(s, keys[depth]);
        if (slot->until == 0 || slot->until <= now)
            break;
        depth++;
    }
    return depth;
}

/* keys[start:] placed here, held until `until` unless reported; -1 on memory error. */
static int
place_keys(KeyStore *s, const uint64_t *keys, Py_ssize_t n, Py_ssize_t start, double until)
{
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        Slot *slot = find(s, keys[i]);
        if (slot->until != 0 && isinf(slot->until))
            continue;                               /* reported already */
        if (put(s, keys[i], until) < 0 || ring_push(s, keys[i], until) < 0)
            return -1;
    }
    return 0;
}

/* Forget the provisional keys whose time is up. */
static void
expire_keys(KeyStore *s, double now)
{
    while (s->ring_len && s->ring[s->ring_head].until <= now) {
        Placed p = s->ring[s->ring_head];
        s->ring_head = (s->ring_head + 1) % s->ring_cap;
        s->ring_len--;
        Slot *slot = find(s, p.key);
        if (slot->until == p.until)     /* not placed again since, nor reported */
            delete(s, slot);
    }
}

static PyObject *
KeyStore_match(KeyStore *s, PyObject *args)
{
    PyObject *obj;
    double now;
    Keys k;
    if (!PyArg_ParseTuple(args, "Od:match", &obj, &now) || keys_of(obj, &k) < 0)
        return NULL;
    Py_ssize_t depth = match_keys(s, k.p, k.n, now);
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
    int failed = place_keys(s, k.p, k.n, start, until);
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
    expire_keys(s, now);
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
    .tp_name = "pdserve.services.router._placement.KeyStore",
    .tp_doc = "One worker's block keys, reported or placed provisionally.",
    .tp_basicsize = sizeof(KeyStore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyStore_new,
    .tp_dealloc = (destructor)KeyStore_dealloc,
    .tp_methods = KeyStore_methods,
    .tp_as_sequence = &KeyStore_as_sequence,
};

/* ---- workers' loads, and the decision ----------------------------------------- */

/* FNV-1a over a str's UTF-8 bytes: a worker's rendezvous seed, a session's hash. */
static int
name_hash(PyObject *str, uint64_t *out)
{
    Py_ssize_t n;
    const char *b = PyUnicode_AsUTF8AndSize(str, &n);
    if (b == NULL)
        return -1;
    uint64_t h = 0xCBF29CE484222325ULL;
    for (Py_ssize_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)b[i]) * 0x100000001B3ULL;
    *out = h;
    return 0;
}

/* A session's rendezvous weight on a worker: splitmix64's finalizer of the two hashes. */
static inline uint64_t
rendezvous(uint64_t session, uint64_t seed)
{
    uint64_t x = session ^ seed;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

typedef struct {
    PyObject_HEAD
    PyObject *worker_id, *model;        /* str */
    uint64_t seed;                      /* name_hash(worker_id) */
    int role;
    char serving, load_pushed;
    double last_seen;
    Py_ssize_t load, routed;
    double *placed_at;                  /* a ring: when each pending placement was made */
    size_t cap, head, len;
} Worker;

static PyObject *
Worker_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Worker *w = (Worker *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->worker_id = PyUnicode_New(0, 0);
    w->model = PyUnicode_New(0, 0);
    if (w->worker_id == NULL || w->model == NULL || name_hash(w->worker_id, &w->seed) < 0) {
        Py_DECREF(w);
        return NULL;
    }
    return (PyObject *)w;
}

static void
Worker_dealloc(Worker *w)
{
    /* A Python subclass's instance (WorkerEntry) comes here from subtype_dealloc, which
     * has untracked it and drops its type's reference itself. */
    Py_XDECREF(w->worker_id);
    Py_XDECREF(w->model);
    PyMem_Free(w->placed_at);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

/* Placements older than `horizon` at `now` no longer count. */
static void
decay(Worker *w, double now, double horizon)
{
    while (w->len && now - w->placed_at[w->head] > horizon) {
        w->head = (w->head + 1) % w->cap;
        w->len--;
    }
}

static PyObject *
Worker_placed(Worker *w, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (w->len == w->cap
            && ring_grow((void **)&w->placed_at, &w->cap, &w->head, w->len, sizeof(double)) < 0)
        return NULL;
    w->placed_at[(w->head + w->len) % w->cap] = now;
    w->len++;
    w->routed++;
    Py_RETURN_NONE;
}

static PyObject *
Worker_clear_pending(Worker *w, PyObject *unused)
{
    w->head = w->len = 0;
    Py_RETURN_NONE;
}

static PyObject *
Worker_decay(Worker *w, PyObject *args)
{
    double now, horizon;
    if (!PyArg_ParseTuple(args, "dd:decay", &now, &horizon))
        return NULL;
    decay(w, now, horizon);
    Py_RETURN_NONE;
}

static PyObject *
Worker_get_str(Worker *w, void *which)
{
    PyObject *v = which ? w->model : w->worker_id;
    return Py_NewRef(v);
}

static int
Worker_set_str(Worker *w, PyObject *v, void *which)
{
    if (v == NULL || !PyUnicode_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "must be a str");
        return -1;
    }
    if (!which && name_hash(v, &w->seed) < 0)
        return -1;
    Py_SETREF(*(which ? &w->model : &w->worker_id), Py_NewRef(v));
    return 0;
}

static PyObject *
Worker_get_pending(Worker *w, void *unused)
{
    return PyLong_FromSize_t(w->len);
}

static PyObject *
Worker_get_seed(Worker *w, void *unused)
{
    return PyLong_FromUnsignedLongLong(w->seed);
}

static PyGetSetDef Worker_getset[] = {
    {"worker_id", (getter)Worker_get_str, (setter)Worker_set_str, "the worker's id", NULL},
    {"model", (getter)Worker_get_str, (setter)Worker_set_str, "the model it serves", ""},
    {"pending", (getter)Worker_get_pending, NULL, "placements not yet in a load report"},
    {"seed", (getter)Worker_get_seed, NULL, "rendezvous seed: name_hash(worker_id)"},
    {NULL},
};

static PyMemberDef Worker_members[] = {
    {"role", T_INT, offsetof(Worker, role), 0, NULL},
    {"serving", T_BOOL, offsetof(Worker, serving), 0, NULL},
    {"load_pushed", T_BOOL, offsetof(Worker, load_pushed), 0, NULL},
    {"last_seen", T_DOUBLE, offsetof(Worker, last_seen), 0, NULL},
    {"load", T_PYSSIZET, offsetof(Worker, load), 0, NULL},
    {"routed", T_PYSSIZET, offsetof(Worker, routed), 0, NULL},
    {NULL},
};

static PyMethodDef Worker_methods[] = {
    {"placed", (PyCFunction)Worker_placed, METH_O,
     "placed(now): one more request placed here, not yet in a load report"},
    {"clear_pending", (PyCFunction)Worker_clear_pending, METH_NOARGS,
     "a load report covers every placement so far"},
    {"decay", (PyCFunction)Worker_decay, METH_VARARGS,
     "decay(now, horizon): placements older than horizon stop counting"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdserve.services.router._placement.Worker",
    .tp_doc = "A worker's load as the router accounts it (registry.WorkerEntry's base).",
    .tp_basicsize = sizeof(Worker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = Worker_new,
    .tp_dealloc = (destructor)Worker_dealloc,
    .tp_methods = Worker_methods,
    .tp_members = Worker_members,
    .tp_getset = Worker_getset,
};

static inline Py_ssize_t
load_of(const Worker *w)
{
    return w->load + (Py_ssize_t)w->len;
}

typedef struct {                        /* decide()'s policy tuple, placement.Policy's */
    double balance, local_fraction;
    Py_ssize_t slack, local_below, saturated, load_tokens;
} Knobs;

enum { REMOTE, SHORT, CACHED, NO_PREFILL, SATURATED };

/* The live workers of `role` for `model` (any if empty), minus `exclude`, into out. */
static int
candidates(PyObject *workers, int role, PyObject *model, PyObject *exclude, double now,
           double timeout, Worker **out, Py_ssize_t *count)
{
    Py_ssize_t n = 0;
    int any_model = PyUnicode_GET_LENGTH(model) == 0;
    int excluding = exclude != Py_None && PySet_GET_SIZE(exclude) > 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(workers); i++) {
        Worker *w = (Worker *)PyTuple_GET_ITEM(workers, i);
        if (w->role != role || !w->serving || now - w->last_seen > timeout)
            continue;
        if (!any_model && w->model != model) {
            int ne = PyUnicode_Compare(w->model, model);
            if (ne == -1 && PyErr_Occurred())
                return -1;
            if (ne)
                continue;
        }
        if (excluding) {
            int in = PySet_Contains(exclude, w->worker_id);
            if (in < 0)
                return -1;
            if (in)
                continue;
        }
        out[n++] = w;
    }
    *count = n;
    return 0;
}

/* How many leading keys each of ws holds, by its store in `stores` (0 without one). */
static int
match_all(PyObject *stores, Worker **ws, Py_ssize_t n, const uint64_t *keys,
          Py_ssize_t n_keys, double now, Py_ssize_t *held)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        held[i] = 0;
        if (!n_keys)
            continue;
        PyObject *s = PyDict_GetItemWithError(stores, ws[i]->worker_id);
        if (s == NULL && PyErr_Occurred())
            return -1;
        if (s != NULL && Py_IS_TYPE(s, &KeyStoreType))
            held[i] = match_keys((KeyStore *)s, keys, n_keys, now);
    }
    return 0;
}

/* The least (uncached tokens + load_tokens x load, routed, worker_id) of ws; -1 on error. */
static Py_ssize_t
least_cost(Worker **ws, Py_ssize_t n, const Py_ssize_t *held, Py_ssize_t n_keys,
           Py_ssize_t block, Py_ssize_t load_tokens)
{
    Py_ssize_t best = 0;
    for (Py_ssize_t i = 1; i < n; i++) {
        Py_ssize_t a = (n_keys - held[i]) * block + load_tokens * load_of(ws[i]);
        Py_ssize_t b = (n_keys - held[best]) * block + load_tokens * load_of(ws[best]);
        if (a != b) {
            if (a < b)
                best = i;
            continue;
        }
        if (ws[i]->routed != ws[best]->routed) {
            if (ws[i]->routed < ws[best]->routed)
                best = i;
            continue;
        }
        int lt = PyUnicode_Compare(ws[i]->worker_id, ws[best]->worker_id);
        if (lt == -1 && PyErr_Occurred())
            return -1;
        if (lt < 0)
            best = i;
    }
    return best;
}

/* The store of `worker_id` in `stores`, made if it has none; borrowed. */
static KeyStore *
store_of(PyObject *stores, PyObject *worker_id)
{
    PyObject *s = PyDict_GetItemWithError(stores, worker_id);
    if (s == NULL) {
        if (PyErr_Occurred())
            return NULL;
        s = PyObject_CallNoArgs((PyObject *)&KeyStoreType);
        if (s == NULL)
            return NULL;
        int failed = PyDict_SetItem(stores, worker_id, s);
        Py_DECREF(s);
        if (failed)
            return NULL;
    }
    if (!Py_IS_TYPE(s, &KeyStoreType)) {
        PyErr_SetString(PyExc_TypeError, "stores must map worker ids to KeyStores");
        return NULL;
    }
    return (KeyStore *)s;
}

/* decide(workers, stores, knobs, model, exclude, prompt, prompt_tokens, block, session,
 *        now, timeout, horizon, index_now, ttl)
 *   -> None (no decode worker) | (decode, prefill | None, cached, reason, uncached, prompt)
 * placement.py's place(), natively: see `_decide` there (the reference) for what each
 * argument is. */
static PyObject *
decide(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 17) {
        PyErr_Format(PyExc_TypeError, "decide() takes 17 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *workers = args[0], *stores = args[1], *knobs_obj = args[2], *model = args[3],
             *exclude = args[4], *prompt_obj = args[5], *session = args[8];
    if (!PyTuple_Check(workers) || !PyDict_Check(stores) || !PyTuple_Check(knobs_obj)
            || PyTuple_GET_SIZE(knobs_obj) != 6 || !PyUnicode_Check(model)
            || !(exclude == Py_None || PyAnySet_Check(exclude)) || !PyBytes_Check(prompt_obj)
            || !PyUnicode_Check(session)) {
        PyErr_SetString(PyExc_TypeError, "decide(): an argument of the wrong type");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(workers); i++)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(workers, i), &WorkerType)) {
            PyErr_SetString(PyExc_TypeError, "decide(): workers must be Workers");
            return NULL;
        }
    Knobs k;
    k.balance = PyFloat_AsDouble(PyTuple_GET_ITEM(knobs_obj, 0));
    k.slack = PyLong_AsSsize_t(PyTuple_GET_ITEM(knobs_obj, 1));
    k.local_below = PyLong_AsSsize_t(PyTuple_GET_ITEM(knobs_obj, 2));
    k.local_fraction = PyFloat_AsDouble(PyTuple_GET_ITEM(knobs_obj, 3));
    k.saturated = PyLong_AsSsize_t(PyTuple_GET_ITEM(knobs_obj, 4));
    k.load_tokens = PyLong_AsSsize_t(PyTuple_GET_ITEM(knobs_obj, 5));
    Py_ssize_t prompt_tokens = PyLong_AsSsize_t(args[6]), block = PyLong_AsSsize_t(args[7]);
    double now = PyFloat_AsDouble(args[9]), timeout = PyFloat_AsDouble(args[10]),
           horizon = PyFloat_AsDouble(args[11]), index_now = PyFloat_AsDouble(args[12]),
           ttl = PyFloat_AsDouble(args[13]);
    /* The cache salt (keystore.salt_points): block 0's parent, and a second salt that
     * folds into the parent of block `salt_at` (0: none). */
    uint64_t root = 0, second = 0;
    Py_ssize_t salt_at = PyLong_AsSsize_t(args[15]);
    if (PyErr_Occurred() || key_arg(args[14], &root) < 0 || key_arg(args[16], &second) < 0)
        return NULL;
    Py_ssize_t packed_len = PyBytes_GET_SIZE(prompt_obj);
    if (packed_len % 4) {
        PyErr_Format(PyExc_ValueError, "packed token ids are 4 bytes each; got %zd bytes",
                     packed_len);
        return NULL;
    }
    if (block < 0 || block > 4096) {
        PyErr_Format(PyExc_ValueError, "block_size must be 0..4096, got %zd", block);
        return NULL;
    }

    Py_ssize_t n_workers = PyTuple_GET_SIZE(workers), n_ids = packed_len / 4;
    Py_ssize_t n_keys = block && n_ids ? n_ids / block : 0;
    if (n_keys > MAX_BLOCKS)
        n_keys = MAX_BLOCKS;
    /* One allocation: candidates (twice), their matches, the ids and the keys. */
    size_t bytes = 2 * n_workers * sizeof(Worker *) + 2 * n_workers * sizeof(Py_ssize_t)
                   + n_keys * block * sizeof(uint64_t)
                   + n_keys * sizeof(uint64_t) + 8;
    char *mem = PyMem_Malloc(bytes);
    if (mem == NULL)
        return PyErr_NoMemory();
    Worker **dec = (Worker **)mem, **pre = dec + n_workers;
    Py_ssize_t *held = (Py_ssize_t *)(pre + n_workers), *pheld = held + n_workers;
    uint64_t *ids = (uint64_t *)(pheld + n_workers), *keys = ids + n_keys * block;
    PyObject *result = NULL;

    for (Py_ssize_t i = 0; i < n_workers; i++)
        decay((Worker *)PyTuple_GET_ITEM(workers, i), now, horizon);
    Py_ssize_t n_dec, n_pre, n_under = 0;
    if (candidates(workers, 2, model, exclude, now, timeout, dec, &n_dec) < 0)
        goto done;
    if (n_dec == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (n_keys) {
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(prompt_obj);
        for (Py_ssize_t i = 0; i < n_keys * block; i++, b += 4)
            ids[i] = (uint64_t)b[0] | (uint64_t)b[1] << 8 | (uint64_t)b[2] << 16
                     | (uint64_t)b[3] << 24;
        Py_ssize_t head = salt_at > 0 && salt_at < n_keys ? salt_at : n_keys;
        hash_blocks(ids, head, block, root, keys);
        if (head < n_keys)
            hash_blocks(ids + head * block, n_keys - head, block, keys[head - 1] ^ second,
                        keys + head);
    }
    Py_ssize_t prompt = n_ids ? n_ids : prompt_tokens;

    /* Bounded load: the decode workers under the cap, or all of them. */
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n_dec; i++)
        total += load_of(dec[i]);
    double mean = (double)(total + 1) / (double)n_dec;
    double cap_rel = ceil(k.balance * mean), cap_abs = ceil(mean) + (double)k.slack;
    double cap = cap_rel > cap_abs ? cap_rel : cap_abs;
    for (Py_ssize_t i = 0; i < n_dec; i++)
        if ((double)(load_of(dec[i]) + 1) <= cap)
            dec[n_under++] = dec[i];
    if (n_under == 0)
        n_under = n_dec;            /* none under the cap: all (dec[] is unchanged) */
    if (match_all(stores, dec, n_under, keys, n_keys, index_now, held) < 0)
        goto done;

    /* Prefix, then session (rendezvous) or cost. */
    Py_ssize_t d = 0;
    if (PyUnicode_GET_LENGTH(session)) {
        uint64_t sh;
        if (name_hash(session, &sh) < 0)
            goto done;
        /* The most held, then the least loaded, then the highest rendezvous weight. */
        uint64_t best = rendezvous(sh, dec[0]->seed);
        for (Py_ssize_t i = 1; i < n_under; i++) {
            uint64_t score = rendezvous(sh, dec[i]->seed);
            Py_ssize_t a = load_of(dec[i]), b = load_of(dec[d]);
            if (held[i] > held[d] || (held[i] == held[d] && (a < b || (a == b && score > best)))) {
                d = i;
                best = score;
            }
        }
    } else if ((d = least_cost(dec, n_under, held, n_keys, block, k.load_tokens)) < 0) {
        goto done;
    }
    Worker *decode = dec[d], *prefill = NULL;
    Py_ssize_t cached = held[d] * block < prompt - 1 ? held[d] * block : prompt - 1;

    /* Conditional disaggregation. */
    Py_ssize_t uncached = prompt - cached;
    int reason;
    if (uncached < k.local_below) {
        reason = SHORT;
    } else if ((double)cached >= k.local_fraction * (double)prompt) {
        reason = CACHED;
    } else {
        if (candidates(workers, 1, model, exclude, now, timeout, pre, &n_pre) < 0)
            goto done;
        Py_ssize_t n_free = 0;
        for (Py_ssize_t i = 0; i < n_pre; i++)
            if (!(k.saturated && pre[i]->load_pushed && load_of(pre[i]) >= k.saturated))
                pre[n_free++] = pre[i];
        if (n_pre == 0) {
            reason = NO_PREFILL;
        } else if (n_free == 0) {
            reason = SATURATED;
        } else {
            if (match_all(stores, pre, n_free, keys, n_keys, index_now, pheld) < 0)
                goto done;
            Py_ssize_t p = least_cost(pre, n_free, pheld, n_keys, block, k.load_tokens);
            if (p < 0)
                goto done;
            prefill = pre[p];
            reason = REMOTE;
        }
    }

    /* The placed prompt counts as held where it went, provisionally. */
    if (n_keys) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(stores, &pos, &key, &value))
            if (Py_IS_TYPE(value, &KeyStoreType))
                expire_keys((KeyStore *)value, index_now);
        KeyStore *s = store_of(stores, decode->worker_id);
        if (s == NULL || place_keys(s, keys, n_keys, held[d], index_now + ttl) < 0)
            goto done;
        if (prefill != NULL) {
            s = store_of(stores, prefill->worker_id);
            if (s == NULL || place_keys(s, keys, n_keys, 0, index_now + ttl) < 0)
                goto done;
        }
    }
    result = Py_BuildValue("(OOnini)", decode, prefill ? (PyObject *)prefill : Py_None,
                           cached, reason, uncached, prompt);
done:
    PyMem_Free(mem);
    return result;
}

static PyMethodDef module_methods[] = {
    {"block_keys", block_keys, METH_VARARGS,
     "block_keys(token_ids, block_size, parent=0) -> bytes of the full blocks' uint64 keys"},
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL,
     "decide(...): placement.place()'s decision, natively (placement.c_decide passes a Query)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_placement",
    "The router's placement, natively (see keystore.py, registry.py, placement.py).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__placement(void)
{
    if (PyType_Ready(&KeyStoreType) < 0 || PyType_Ready(&WorkerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeyStore", (PyObject *)&KeyStoreType) < 0
            || PyModule_AddObjectRef(m, "Worker", (PyObject *)&WorkerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
