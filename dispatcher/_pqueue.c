/*
 * IndexedHeap: a binary min-heap of Python objects keyed by (float key, int tie), with
 * O(log n) re-keying and removal of any item (see paella.dispatcher.pqueue for why).
 *
 * Layout: the heap is an array of entries {key, tie, item, slot}; a hash table
 * (open addressing, linear probing, keyed by the item's address) maps each item to its
 * heap position. An entry knows its table slot, so moving an entry during a sift is
 * one store; deleting from the table shifts later slots back (no tombstones) and fixes
 * the positions they point to. Items are compared by identity, never by value.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    double key;
    long long tie;
    PyObject *item;
    Py_ssize_t slot;             /* its slot in the table */
} Entry;

typedef struct {
    PyObject *item;              /* NULL: empty */
    Py_ssize_t pos;              /* its index in the heap */
} Slot;

typedef struct {
    PyObject_HEAD
    Entry *heap;
    Py_ssize_t n, cap;
    Slot *table;
    Py_ssize_t tmask;            /* table size - 1 (a power of two, >= 2 * cap) */
} Heap;

/* -- the table ------------------------------------------------------------------------- */
static inline Py_ssize_t hash_of(Heap *h, PyObject *item)
{
    uint64_t x = (uint64_t)(uintptr_t)item;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (Py_ssize_t)(x & (uint64_t)h->tmask);
}

/* The slot holding item, or the empty slot where it would go. */
static inline Py_ssize_t find(Heap *h, PyObject *item)
{
    Py_ssize_t i = hash_of(h, item);
    while (h->table[i].item != NULL && h->table[i].item != item)
        i = (i + 1) & h->tmask;
    return i;
}

static void table_delete(Heap *h, Py_ssize_t i)
{
    /* Backward-shift deletion: move later members of the probe run into the hole. */
    Py_ssize_t j = i;
    for (;;) {
        h->table[i].item = NULL;
        for (;;) {
            j = (j + 1) & h->tmask;
            if (h->table[j].item == NULL)
                return;
            Py_ssize_t home = hash_of(h, h->table[j].item);
            /* j's item may fill the hole at i iff its home is not in (i, j] cyclically */
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j))
                break;
        }
        h->table[i] = h->table[j];
        h->heap[h->table[i].pos].slot = i;
        i = j;
    }
}

static int grow(Heap *h)
{
    Py_ssize_t cap = h->cap ? 2 * h->cap : 16, tsize = 4 * cap;
    Entry *heap = PyMem_Realloc(h->heap, cap * sizeof(Entry));
    if (heap == NULL)
        return -1;
    h->heap = heap;
    Slot *table = PyMem_Calloc(tsize, sizeof(Slot));
    if (table == NULL)
        return -1;
    PyMem_Free(h->table);
    h->table = table;
    h->tmask = tsize - 1;
    h->cap = cap;
    for (Py_ssize_t k = 0; k < h->n; k++) {
        Py_ssize_t s = find(h, heap[k].item);
        table[s].item = heap[k].item;
        table[s].pos = k;
        heap[k].slot = s;
    }
    return 0;
}

/* -- the heap -------------------------------------------------------------------------- */
static inline int less(const Entry *a, const Entry *b)
{
    return a->key < b->key || (a->key == b->key && a->tie < b->tie);
}

static inline void place(Heap *h, Py_ssize_t k, Entry e)
{
    h->heap[k] = e;
    h->table[e.slot].pos = k;
}

static void sift_up(Heap *h, Py_ssize_t k)
{
    Entry e = h->heap[k];
    while (k > 0) {
        Py_ssize_t p = (k - 1) >> 1;
        if (!less(&e, &h->heap[p]))
            break;
        place(h, k, h->heap[p]);
        k = p;
    }
    place(h, k, e);
}

static void sift_down(Heap *h, Py_ssize_t k)
{
    Entry e = h->heap[k];
    Py_ssize_t n = h->n;
    for (;;) {
        Py_ssize_t c = 2 * k + 1;
        if (c >= n)
            break;
        if (c + 1 < n && less(&h->heap[c + 1], &h->heap[c]))
            c++;
        if (!less(&h->heap[c], &e))
            break;
        place(h, k, h->heap[c]);
        k = c;
    }
    place(h, k, e);
}

/* Remove the entry at heap index k; the caller owns the item's reference after. */
static PyObject *take(Heap *h, Py_ssize_t k)
{
    Entry e = h->heap[k];
    table_delete(h, e.slot);
    h->n--;
    if (k < h->n) {
        Entry last = h->heap[h->n];
        place(h, k, last);
        if (k > 0 && less(&last, &h->heap[(k - 1) >> 1]))
            sift_up(h, k);
        else
            sift_down(h, k);
    }
    return e.item;
}

/* -- methods --------------------------------------------------------------------------- */
static PyObject *Heap_push(Heap *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "push(item, key, tie) takes 3 arguments");
        return NULL;
    }
    PyObject *item = args[0];
    double key = PyFloat_AsDouble(args[1]);
    if (key == -1.0 && PyErr_Occurred())
        return NULL;
    if (key != key) {
        PyErr_SetString(PyExc_ValueError, "push(): the key is NaN, which does not order");
        return NULL;
    }
    long long tie = PyLong_AsLongLong(args[2]);
    if (tie == -1 && PyErr_Occurred())
        return NULL;
    if (h->cap) {
        Py_ssize_t s = find(h, item);
        if (h->table[s].item != NULL) {            /* present: re-key */
            Py_ssize_t k = h->table[s].pos;
            Entry old = h->heap[k];
            h->heap[k].key = key;
            h->heap[k].tie = tie;
            if (less(&h->heap[k], &old))
                sift_up(h, k);
            else
                sift_down(h, k);
            Py_RETURN_NONE;
        }
    }
    if (h->n == h->cap && grow(h) < 0)
        return PyErr_NoMemory();
    Py_ssize_t s = find(h, item);
    Py_INCREF(item);
    h->table[s].item = item;
    Entry e = {key, tie, item, s};
    h->heap[h->n] = e;
    h->table[s].pos = h->n;
    h->n++;
    sift_up(h, h->n - 1);
    Py_RETURN_NONE;
}

static PyObject *Heap_remove(Heap *h, PyObject *item)
{
    if (!h->n)
        Py_RETURN_FALSE;
    Py_ssize_t s = find(h, item);
    if (h->table[s].item == NULL)
        Py_RETURN_FALSE;
    Py_DECREF(take(h, h->table[s].pos));
    Py_RETURN_TRUE;
}

static PyObject *Heap_top(Heap *h, PyObject *unused)
{
    if (!h->n)
        Py_RETURN_NONE;
    return Py_NewRef(h->heap[0].item);
}

static PyObject *Heap_top_key(Heap *h, PyObject *unused)
{
    if (!h->n) {
        PyErr_SetString(PyExc_IndexError, "top_key() of an empty heap");
        return NULL;
    }
    return PyFloat_FromDouble(h->heap[0].key);
}

static PyObject *Heap_pop(Heap *h, PyObject *unused)
{
    if (!h->n) {
        PyErr_SetString(PyExc_IndexError, "pop() from an empty heap");
        return NULL;
    }
    return take(h, 0);
}

static PyObject *Heap_key(Heap *h, PyObject *item)
{
    Py_ssize_t s = h->n ? find(h, item) : 0;
    if (!h->n || h->table[s].item == NULL) {
        PyErr_SetObject(PyExc_KeyError, item);
        return NULL;
    }
    Entry *e = &h->heap[h->table[s].pos];
    return Py_BuildValue("(dL)", e->key, e->tie);
}

static PyObject *Heap_shift(Heap *h, PyObject *arg)
{
    double d = PyFloat_AsDouble(arg);
    if (d == -1.0 && PyErr_Occurred())
        return NULL;
    if (!isfinite(d)) {
        PyErr_SetString(PyExc_ValueError, "shift(): the delta must be finite");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < h->n; k++)
        h->heap[k].key += d;
    /* Rounding may merge two keys (the tie then decides): restore the heap order. */
    for (Py_ssize_t k = h->n / 2 - 1; k >= 0; k--)
        sift_down(h, k);
    Py_RETURN_NONE;
}

static PyObject *Heap_items(Heap *h, PyObject *unused)
{
    PyObject *out = PyList_New(h->n);
    for (Py_ssize_t k = 0; out != NULL && k < h->n; k++)
        PyList_SET_ITEM(out, k, Py_NewRef(h->heap[k].item));
    return out;
}

static int Heap_clear(Heap *h)
{
    /* Empty the structure first, release the items after: a finalizer that runs on a
       release may use the heap again. */
    Py_ssize_t n = h->n;
    if (!n)
        return 0;
    PyObject **items = PyMem_Malloc(n * sizeof(PyObject *));
    if (items == NULL) {             /* (no memory: release in place, as the last resort) */
        while (h->n)
            Py_DECREF(take(h, h->n - 1));
        return 0;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        items[k] = h->heap[k].item;
        h->table[h->heap[k].slot].item = NULL;
    }
    h->n = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        Py_DECREF(items[k]);
    PyMem_Free(items);
    return 0;
}

static PyObject *Heap_clear_method(Heap *h, PyObject *unused)
{
    Heap_clear(h);
    Py_RETURN_NONE;
}

static int Heap_traverse(Heap *h, visitproc visit, void *arg)
{
    for (Py_ssize_t k = 0; k < h->n; k++)
        Py_VISIT(h->heap[k].item);
    return 0;
}

static void Heap_dealloc(Heap *h)
{
    PyObject_GC_UnTrack(h);
    Heap_clear(h);
    PyMem_Free(h->heap);
    PyMem_Free(h->table);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static int Heap_init(Heap *h, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "IndexedHeap() takes no arguments");
        return -1;
    }
    return 0;
}

static Py_ssize_t Heap_len(Heap *h)
{
    return h->n;
}

static int Heap_contains(Heap *h, PyObject *item)
{
    return h->n && h->table[find(h, item)].item != NULL;
}

static PySequenceMethods Heap_as_sequence = {
    .sq_length = (lenfunc)Heap_len,
    .sq_contains = (objobjproc)Heap_contains,
};

static PyMethodDef Heap_methods[] = {
    {"push", (PyCFunction)(void (*)(void))Heap_push, METH_FASTCALL,
     "push(item, key, tie): insert item, or re-key it if present"},
    {"remove", (PyCFunction)Heap_remove, METH_O, "remove(item) -> bool (False: absent)"},
    {"top", (PyCFunction)Heap_top, METH_NOARGS, "the item of least (key, tie), or None"},
    {"top_key", (PyCFunction)Heap_top_key, METH_NOARGS, "the least key (IndexError if empty)"},
    {"pop", (PyCFunction)Heap_pop, METH_NOARGS, "remove and return the top item"},
    {"key", (PyCFunction)Heap_key, METH_O, "key(item) -> (key, tie); KeyError if absent"},
    {"shift", (PyCFunction)Heap_shift, METH_O, "add a constant to every key"},
    {"items", (PyCFunction)Heap_items, METH_NOARGS, "the items, in heap (not sorted) order"},
    {"clear", (PyCFunction)Heap_clear_method, METH_NOARGS, "remove every item"},
    {NULL}
};

static PyTypeObject HeapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher._pqueue.IndexedHeap",
    .tp_basicsize = sizeof(Heap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A min-heap of objects keyed by (float, int), with re-keying and removal "
              "of any item in O(log n) (see paella.dispatcher.pqueue).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Heap_init,
    .tp_dealloc = (destructor)Heap_dealloc,
    .tp_traverse = (traverseproc)Heap_traverse,
    .tp_clear = (inquiry)Heap_clear,
    .tp_methods = Heap_methods,
    .tp_as_sequence = &Heap_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paella.dispatcher._pqueue",
    "C half of paella.dispatcher.pqueue.", -1, NULL,
};

PyMODINIT_FUNC PyInit__pqueue(void)
{
    if (PyType_Ready(&HeapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "IndexedHeap", (PyObject *)&HeapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
