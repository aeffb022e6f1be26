/*
 * The simulator's functional answers' byte work on a thread of its own: whole-input
 * comparisons, and the digest that keys them.
 *
 * The simulated GPU answers a request with the reference outputs of an input it has seen
 * before, after comparing the whole input with the one cached (paella.dispatcher.daemon.
 * bundles.FunctionalCache). With cold caches that compare costs 100-150 us of memory
 * traffic, on the request's critical path if the dispatcher's loop does it. Here it runs
 * on a worker thread that never takes the GIL: the loop starts it when the input is in
 * device memory (the plan's first kernel after its input copies completes) and collects
 * the answer when the last kernel completes, hundreds of microseconds later. (Waking the
 * worker costs ~150 us of latency on the 2-core VMs this was measured on: work that must
 * be done sooner, such as an input copy's memcpy, stays on the loop.)
 *
 *   pending = compare(inputs, candidates)
 *       inputs: a sequence of contiguous buffers (the request's input tensors);
 *       candidates: a sequence of sequences of as many buffers (cached inputs).
 *   pending.result() -> int   the index of the first candidate whose every buffer equals
 *                              the input's, or -1; waits without the GIL if not done.
 *   pending.done -> bool
 *   digest(buffers, sample) -> 16 bytes (on the caller's thread; see digest()).
 *
 * A pending comparison holds its buffers (Py_buffer views) until it is collected or
 * dropped, so neither side can be freed under the worker; dropping it waits for the
 * work. One worker thread per process, started on first use and again in a child after
 * fork (a comparison inherited by a child was never run there: it is reported as no
 * match, and the caller compares again itself).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct Job {
    struct Job *next;
    Py_ssize_t n_in, n_cand;
    Py_buffer *bufs;             /* n_in * (1 + n_cand): the inputs, then each candidate's */
    int nbufs;                   /* how many of bufs are held (released at dealloc) */
    int result;
    int done;                    /* under mu */
} Job;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static Job *head, *tail, *current;
static pid_t worker_pid;        /* the process whose worker runs (0: none) */

static int compare_job(Job *j)
{
    for (Py_ssize_t c = 0; c < j->n_cand; c++) {
        Py_ssize_t i = 0;
        for (; i < j->n_in; i++) {
            Py_buffer *a = &j->bufs[i], *b = &j->bufs[(c + 1) * j->n_in + i];
            if (a->len != b->len || memcmp(a->buf, b->buf, (size_t)a->len) != 0)
                break;
        }
        if (i == j->n_in)
            return (int)c;
    }
    return -1;
}

static void *worker(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (head == NULL)
            pthread_cond_wait(&work_cv, &mu);
        Job *j = head;
        head = j->next;
        if (head == NULL)
            tail = NULL;
        current = j;
        pthread_mutex_unlock(&mu);
        int r = compare_job(j);
        pthread_mutex_lock(&mu);
        if (current == j) {         /* (a fork in between leaves no job current here) */
            j->result = r;
            j->done = 1;
            current = NULL;
            pthread_cond_broadcast(&done_cv);
        }
    }
    return NULL;
}

/* In a child after fork: no worker runs there; whatever was queued or running is
 * reported as no match (the caller then compares synchronously). */
static void after_fork_child(void)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c1 = PTHREAD_COND_INITIALIZER, c2 = PTHREAD_COND_INITIALIZER;
    memcpy(&mu, &m, sizeof m);
    memcpy(&work_cv, &c1, sizeof c1);
    memcpy(&done_cv, &c2, sizeof c2);
    for (Job *j = head; j != NULL; j = j->next) {
        j->result = -1;
        j->done = 1;
    }
    if (current != NULL) {
        current->result = -1;
        current->done = 1;
    }
    head = tail = current = NULL;
    worker_pid = 0;
}

/* The CPUs the worker may run on: not the caller's. A thread inherits its creator's
 * affinity, and the dispatcher's loop may be pinned to one core (paella serve --cpu):
 * the worker then goes to the other cores, where the clients run; a caller on several
 * cores keeps them but the one it is on now. Woken on the caller's core, the worker
 * would preempt the loop for the whole comparison (measured: 58 us per request). Best
 * effort: on one core, or if the system refuses, the worker stays where it is. */
static void place_worker(pthread_t t)
{
    cpu_set_t mine, other;
    if (pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) != 0)
        return;
    CPU_ZERO(&other);
    if (CPU_COUNT(&mine) == 1) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        for (long c = 0; c < n && c < CPU_SETSIZE; c++)
            if (!CPU_ISSET(c, &mine))
                CPU_SET(c, &other);
    } else {
        int here = sched_getcpu();
        CPU_OR(&other, &mine, &mine);
        if (here >= 0 && here < CPU_SETSIZE)
            CPU_CLR(here, &other);
    }
    if (CPU_COUNT(&other) > 0)
        (void)pthread_setaffinity_np(t, sizeof other, &other);
}

/* Under mu. */
static int ensure_worker(void)
{
    if (worker_pid == getpid())
        return 0;
    pthread_t t;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&t, &attr, worker, NULL);
    pthread_attr_destroy(&attr);
    if (err != 0)
        return -1;
    place_worker(t);
    worker_pid = getpid();
    return 0;
}

/* -- Pending ---------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    Job *job;
} Pending;

/* Take j out of the queue if the worker has not begun it; under mu. */
static int unqueue(Job *j)
{
    Job *prev = NULL;
    for (Job *q = head; q != NULL; prev = q, q = q->next) {
        if (q != j)
            continue;
        if (prev != NULL)
            prev->next = j->next;
        else
            head = j->next;
        if (tail == j)
            tail = prev;
        j->next = NULL;
        return 1;
    }
    return 0;
}

/* Wait for j. One the worker has not begun is done here instead (with the GIL released):
 * waking the worker can take longer than the work (~150 us across cores on the VMs this
 * was measured on), and collecting then costs no more than comparing on the loop. */
static void wait_done(Job *j)
{
    pthread_mutex_lock(&mu);
    int done = j->done, mine = !done && unqueue(j);
    pthread_mutex_unlock(&mu);
    if (done)
        return;
    Py_BEGIN_ALLOW_THREADS
    if (mine) {
        int r = compare_job(j);
        pthread_mutex_lock(&mu);
        j->result = r;
        j->done = 1;
        pthread_cond_broadcast(&done_cv);   /* (another thread may wait on the same one) */
    } else {
        pthread_mutex_lock(&mu);
        while (!j->done)
            pthread_cond_wait(&done_cv, &mu);
    }
    pthread_mutex_unlock(&mu);
    Py_END_ALLOW_THREADS
}

static void free_job(Job *j)
{
    for (int i = 0; i < j->nbufs; i++)
        PyBuffer_Release(&j->bufs[i]);
    PyMem_Free(j->bufs);
    PyMem_Free(j);
}

static void Pending_dealloc(Pending *self)
{
    if (self->job != NULL) {
        wait_done(self->job);       /* the worker may be reading its buffers */
        free_job(self->job);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pending_result(Pending *self, PyObject *Py_UNUSED(ignored))
{
    wait_done(self->job);
    return PyLong_FromLong(self->job->result);
}

static PyObject *Pending_get_done(Pending *self, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&mu);
    int done = self->job->done;
    pthread_mutex_unlock(&mu);
    return PyBool_FromLong(done);
}

static PyMethodDef Pending_methods[] = {
    {"result", (PyCFunction)Pending_result, METH_NOARGS,
     "The index of the first candidate equal to the input, or -1 (waits without the GIL)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pending_getset[] = {
    {"done", (getter)Pending_get_done, NULL, "Whether the comparison has finished.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PendingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "paella.dispatcher.devices.sim._offload.Pending",
    .tp_basicsize = sizeof(Pending),
    .tp_dealloc = (destructor)Pending_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A comparison running on the worker thread (see compare()).",
    .tp_methods = Pending_methods,
    .tp_getset = Pending_getset,
};

/* Acquire the buffers of a sequence of n objects into bufs[0..n). */
static int hold(PyObject *seq, Py_ssize_t n, Job *j, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd buffers, expected %zd", what,
                     PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* PyBUF_SIMPLE: contiguous bytes, or BufferError (the caller compares itself) */
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &j->bufs[j->nbufs],
                               PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        j->nbufs++;
    }
    Py_DECREF(fast);
    return 0;
}

static Job *new_job(Py_ssize_t n_in, Py_ssize_t n_cand)
{
    Job *j = PyMem_Calloc(1, sizeof(Job));
    if (j == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    j->n_in = n_in;
    j->n_cand = n_cand;
    j->bufs = PyMem_Calloc((size_t)(n_in * (n_cand + 1)) + 1, sizeof(Py_buffer));
    if (j->bufs == NULL) {
        PyMem_Free(j);
        PyErr_NoMemory();
        return NULL;
    }
    return j;
}

/* Queue j (its buffers held) for the worker; its Pending, or NULL (j freed). */
static PyObject *enqueue(Job *j, int result)
{
    Pending *p = PyObject_New(Pending, &PendingType);
    if (p == NULL) {
        free_job(j);
        return NULL;
    }
    p->job = NULL;
    pthread_mutex_lock(&mu);
    if (ensure_worker() < 0) {
        pthread_mutex_unlock(&mu);
        Py_DECREF(p);
        free_job(j);
        PyErr_SetString(PyExc_RuntimeError, "_offload: cannot start the worker thread");
        return NULL;
    }
    j->result = result;
    if (tail != NULL)
        tail->next = j;
    else
        head = j;
    tail = j;
    p->job = j;
    pthread_cond_signal(&work_cv);
    pthread_mutex_unlock(&mu);
    return (PyObject *)p;
}

static PyObject *compare(PyObject *mod, PyObject *args)
{
    PyObject *inputs, *candidates;
    if (!PyArg_ParseTuple(args, "OO:compare", &inputs, &candidates))
        return NULL;
    Py_ssize_t n_in = PySequence_Size(inputs), n_cand = PySequence_Size(candidates);
    if (n_in < 0 || n_cand < 0)
        return NULL;
    if (n_in > 1 << 16 || n_cand > 1 << 16) {
        PyErr_SetString(PyExc_ValueError, "compare: more than 65536 buffers or candidates");
        return NULL;
    }
    Job *j = new_job(n_in, n_cand);
    if (j == NULL)
        return NULL;
    if (hold(inputs, n_in, j, "compare: inputs") < 0)
        goto fail;
    for (Py_ssize_t c = 0; c < n_cand; c++) {
        PyObject *cand = PySequence_GetItem(candidates, c);
        if (cand == NULL)
            goto fail;
        int r = hold(cand, n_in, j, "compare: a candidate");
        Py_DECREF(cand);
        if (r < 0)
            goto fail;
    }
    return enqueue(j, -1);
fail:
    free_job(j);
    return NULL;
}

/* -- digest ----------------------------------------------------------------------------- */
static inline uint64_t mix(uint64_t h, uint64_t w)
{
    h ^= w;
    h *= 0x9e3779b97f4a7c15ULL;
    return h ^ (h >> 29);
}

/* digest(buffers, sample) -> 16 bytes: of each buffer's length and of every step-th byte,
 * step = max(1, len // sample) (a strided sample: bytes from the whole input at the cost
 * of ~sample cache lines). Not cryptographic: a key, whose hits are confirmed by
 * comparing whole inputs. */
static PyObject *digest(PyObject *mod, PyObject *args)
{
    PyObject *bufs;
    Py_ssize_t sample;
    if (!PyArg_ParseTuple(args, "On:digest", &bufs, &sample))
        return NULL;
    if (sample < 1) {
        PyErr_SetString(PyExc_ValueError, "digest: sample must be >= 1");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(bufs, "digest: a sequence of buffers");
    if (fast == NULL)
        return NULL;
    uint64_t h1 = 0x243f6a8885a308d3ULL, h2 = 0x13198a2e03707344ULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &b, PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        const unsigned char *p = b.buf;
        Py_ssize_t step = b.len / sample > 1 ? b.len / sample : 1;
        h1 = mix(h1, (uint64_t)b.len);
        h2 = mix(h2, (uint64_t)b.len + 1);
        uint64_t w = 0;
        int k = 0;
        for (Py_ssize_t at = 0; at < b.len; at += step) {
            w = w << 8 | p[at];
            if (++k == 8) {
                h1 = mix(h1, w);
                h2 = mix(h2 + 0x632be59bd9b4e019ULL, w);
                w = 0;
                k = 0;
            }
        }
        h1 = mix(h1, w ^ (uint64_t)k << 56);
        h2 = mix(h2, w + k);
        PyBuffer_Release(&b);
    }
    Py_DECREF(fast);
    unsigned char out[16];
    memcpy(out, &h1, 8);
    memcpy(out + 8, &h2, 8);
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

static PyMethodDef module_methods[] = {
    {"digest", digest, METH_VARARGS,
     "digest(buffers, sample) -> bytes: a 16-byte key of each buffer's length and a "
     "strided sample of about `sample` of its bytes (not cryptographic)."},
    {"compare", compare, METH_VARARGS,
     "compare(inputs, candidates) -> Pending: compare the input buffers with each "
     "candidate's on the worker thread."},

    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "paella.dispatcher.devices.sim._offload",
    "The functional answers' comparisons on a worker thread, and their digest.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__offload(void)
{
    static int registered;
    if (!registered) {
        if (pthread_atfork(NULL, NULL, after_fork_child) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "_offload: pthread_atfork failed");
            return NULL;
        }
        registered = 1;
    }
    if (PyType_Ready(&PendingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PendingType);
    if (PyModule_AddObject(m, "Pending", (PyObject *)&PendingType) < 0) {
        Py_DECREF(&PendingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
