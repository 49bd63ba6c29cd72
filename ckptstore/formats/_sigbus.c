/* A SIGBUS handler that turns a read past the end of a cut-short mapped file into zeros (formats/filemap.py).
 *
 * A commit reads the user's checkpoint through memory maps; when the training run truncates the
 * file meanwhile (torch.save opens it with "wb"), touching a page past the new end raises SIGBUS,
 * which kills the process (the daemon, under `ckpt daemon`). Python registers each mapping it
 * makes for a commit in a fixed table of address ranges; a fault inside one is answered by
 * mapping an anonymous zero page over the faulting page and counting it, so the access re-runs,
 * reads zeros, and the commit refuses the file afterwards (repo/commit.py's _settle_changed).
 * A fault anywhere else restores the previous action and returns, so the access re-runs into it:
 * by default the process dies exactly as before.
 *
 * The table is written only from Python (under the GIL) and read lock-free by the handler: a slot
 * is live while its end is non-zero, and end is written last when registering, first when not.
 * The handler calls only mmap and sigaction (system calls; mmap is not on POSIX's list of
 * async-signal-safe functions, but on Linux it is the bare system call, as JVMs rely on).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS 4096

struct range {
    volatile uintptr_t start;
    volatile uintptr_t end; /* 0: a free slot */
    volatile uint64_t hits;
};

static struct range table[SLOTS];
static volatile uint64_t fault_count;
static uintptr_t page_size;
static struct sigaction previous;
static int installed;
static volatile sig_atomic_t passed_on; /* a fault not ours went to previous once already */

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    uintptr_t address = (uintptr_t)info->si_addr;
    (void)context;
    /* a signal sent (kill, raise: si_code <= 0) has no faulting address: si_addr holds the sender's ids */
    for (int i = 0; info->si_code > 0 && i < SLOTS; i++) {
        uintptr_t end = table[i].end;
        if (end && address >= table[i].start && address < end) {
            void *page = (void *)(address & ~(page_size - 1));
            if (mmap(page, page_size, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                    == MAP_FAILED)
                break;
            table[i].hits++;
            fault_count++;
            return;
        }
    }
    /* not ours: the access re-runs into whatever handled SIGBUS before (by default, death); a
     * signal that is no fault (kill -BUS, raise) would not come again by itself: it is sent again.
     * A handler set after us chains back to us: the second time round, the default ends it. */
    if (passed_on) {
        struct sigaction fallback;
        memset(&fallback, 0, sizeof fallback);
        fallback.sa_handler = SIG_DFL;
        sigaction(sig, &fallback, NULL);
    } else {
        passed_on = 1;
        sigaction(sig, &previous, NULL);
    }
    installed = 0;
    if (info->si_code <= 0)
        raise(sig);
}

static PyObject *install(PyObject *self, PyObject *unused)
{
    struct sigaction ours, current;
    (void)self;
    (void)unused;
    if (sigaction(SIGBUS, NULL, &current) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (installed && current.sa_sigaction == on_sigbus)
        Py_RETURN_NONE;
    /* someone (faulthandler.enable, say) took SIGBUS after us, or we stood down: chain to theirs */
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    if (current.sa_sigaction != on_sigbus)
        previous = current;
    passed_on = 0; /* the loop guard holds within one signal's chain; none runs while this does */
    if (sigaction(SIGBUS, &ours, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    installed = 1;
    Py_RETURN_NONE;
}

static PyObject *register_range(PyObject *self, PyObject *args)
{
    unsigned long long start, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &start, &length))
        return NULL;
    if (!length)
        return PyLong_FromLong(-1);
    for (int i = 0; i < SLOTS; i++) {
        if (!table[i].end) {
            table[i].hits = 0;
            table[i].start = (uintptr_t)start;
            __atomic_store_n(&table[i].end, (uintptr_t)(start + length), __ATOMIC_RELEASE);
            return PyLong_FromLong(i);
        }
    }
    return PyLong_FromLong(-1); /* full: the mapping is unguarded, as before */
}

/* The first address of a buffer (a read-only mmap included): filemap's maps, without numpy. */
static PyObject *address_of(PyObject *self, PyObject *args)
{
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*", &view))
        return NULL;
    PyObject *start = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return start;
}

static PyObject *unregister(PyObject *self, PyObject *args)
{
    int slot;
    uint64_t hits;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &slot))
        return NULL;
    if (slot < 0 || slot >= SLOTS)
        return PyLong_FromLong(0);
    __atomic_store_n(&table[slot].end, (uintptr_t)0, __ATOMIC_RELEASE);
    hits = table[slot].hits;
    table[slot].start = 0;
    return PyLong_FromUnsignedLongLong(hits);
}

static PyObject *hits(PyObject *self, PyObject *args)
{
    int slot;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &slot))
        return NULL;
    return PyLong_FromUnsignedLongLong(slot >= 0 && slot < SLOTS ? table[slot].hits : 0);
}

static PyObject *faults(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(fault_count);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, "Install the SIGBUS handler (again, if another took SIGBUS since)."},
    {"register", register_range, METH_VARARGS, "register(start, length) -> slot (-1: table full, unguarded)."},
    {"address", address_of, METH_VARARGS, "address(buffer) -> its first byte's address."},
    {"unregister", unregister, METH_VARARGS, "unregister(slot) -> faults answered in it."},
    {"hits", hits, METH_VARARGS, "hits(slot) -> faults answered in it so far."},
    {"faults", faults, METH_NOARGS, "Faults answered with a zero page since the process started."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sigbus", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sigbus(void)
{
    return PyModule_Create(&module);
}
