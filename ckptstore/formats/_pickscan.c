/* A walk over a pickle's opcodes that runs nothing: may the C unpickler load it, and may any reader? (torchzip.py)
 *
 * The restricted reader runs torch.save's data.pkl on the pure-Python unpickler, whose dispatch
 * table holds only the opcodes torch's weights_only loader implements (and later protocols' plain
 * ones). The C unpickler is faster but runs every opcode it knows, and sizes its memo by the
 * largest index a PUT names (LONG_BINPUT 0xffffffff would ask for 32 GiB). This walk answers
 * "plain" only to a protocol-2 pickle whose every opcode up to STOP is one of torch's (1 in
 * `table`, a 256-byte table made in Python from the same opcode sets), with every argument inside
 * the data and every PUT's memo index one already stored or the next one (as Python's pickler
 * numbers them: the memo then grows by one entry per PUT of a new index, each a distinct opcode,
 * not with a PUT repeated, which a deflated zip entry packs a thousand to the byte, nor with bytes
 * after STOP); anything else is "other", read by the Python unpickler exactly as before.
 *
 * It answers "too deep" where a tuple nests more than `max_depth` deep anywhere any reader would
 * go (torch's opcodes and those only the Python reader runs, 2 in `table`, up to where both stop):
 * CPython 3.11 hashes a tuple recursively without a guard, so a dict key of a million nested
 * tuples (a 1 KB deflated zip) overflows the C stack in every unpickler, torch's included. Lists,
 * dicts and sets end that recursion (they are not hashable), so only direct tuple nesting counts;
 * calls and BUILD are taken to be as deep as their operands. It answers "too big" where a tuple's
 * hash would visit more than `max_visits` items: a 250-byte pickle that builds t = (t, t) sixty
 * times through the memo is only 60 deep, but its hash visits 2**61 items (a hang), as each
 * shared tuple is hashed again wherever it occurs; the walk counts them so (saturating), with
 * lists, dicts and sets as one item and calls as costly as their operands. Opcodes whose argument
 * layout this file does not know stop the walk whatever `table` says.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Bytes after the opcode at `p` (or -1 where the layout is unknown, or runs past `end`). */
static Py_ssize_t arg_length(const uint8_t *p, const uint8_t *end)
{
    const uint8_t *arg = p + 1;
    Py_ssize_t left = end - arg;
    switch (*p) {
    case '.': case 0x81: case 'R': case 'b': case 'a': case 'e': case 's': case 'u': case '(': case 't':
    case 0x85: case 0x86: case 0x87: case 'N': case 0x88: case 0x89: case ')': case ']': case '}':
    case 0x8f: case 'Q': case 0x90: case 0x93: case 0x94:
        return 0;
    case 0x80: case 'K': case 'h': case 'q': /* PROTO, BININT1, BINGET, BINPUT: one byte */
        return left >= 1 ? 1 : -1;
    case 'M':
        return left >= 2 ? 2 : -1;
    case 'J': case 'j': case 'r':
        return left >= 4 ? 4 : -1;
    case 'G': case 0x95: /* BINFLOAT, FRAME */
        return left >= 8 ? 8 : -1;
    case 0x8d: case 0x8e: { /* BINUNICODE8, BINBYTES8: an 8-byte length */
        if (left < 8)
            return -1;
        uint64_t length = (uint64_t)le32(arg) | (uint64_t)le32(arg + 4) << 32;
        return length <= (uint64_t)(left - 8) ? 8 + (Py_ssize_t)length : -1;
    }
    case 'U': case 0x8a: case 'C': case 0x8c: /* SHORT_BINSTRING, LONG1, SHORT_BINBYTES, SHORT_BINUNICODE: a length byte */
        return left >= 1 && left - 1 >= arg[0] ? 1 + arg[0] : -1;
    case 'X': case 'B': /* BINUNICODE, BINBYTES: a 4-byte length */
        return left >= 4 && (uint64_t)le32(arg) <= (uint64_t)(left - 4) ? 4 + (Py_ssize_t)le32(arg) : -1;
    case 'c': { /* GLOBAL: two newline-terminated lines */
        const uint8_t *first = memchr(arg, '\n', (size_t)left);
        if (first == NULL)
            return -1;
        const uint8_t *second = memchr(first + 1, '\n', (size_t)(end - first - 1));
        return second == NULL ? -1 : second + 1 - arg;
    }
    default:
        return -1;
    }
}

/* Make room for one more item in a growable array of the walk's bookkeeping; a failed allocation raises MemoryError. */
static int room_for_one(void **items, Py_ssize_t len, Py_ssize_t *cap, size_t size)
{
    if (len < *cap)
        return 0;
    Py_ssize_t grown_cap = *cap ? 2 * *cap : 256;
    void *grown = PyMem_Realloc(*items, (size_t)grown_cap * size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *items = grown;
    *cap = grown_cap;
    return 0;
}

/* What hashing a value would cost: how deep its tuples nest, and how many items the hash visits (1 for anything
 * but a tuple; a tuple's own 1 plus its items', a shared one counted each time it occurs), saturating. */
typedef struct {
    uint32_t depth, visits;
} Cost;

typedef struct {
    Cost *items;
    Py_ssize_t len, cap;
} Costs;

typedef struct {
    Py_ssize_t *items;
    Py_ssize_t len, cap;
} Marks;

static int costs_push(Costs *c, Cost value)
{
    if (room_for_one((void **)&c->items, c->len, &c->cap, sizeof(Cost)) < 0)
        return -1;
    c->items[c->len++] = value;
    return 0;
}

static int marks_push(Marks *m, Py_ssize_t value)
{
    if (room_for_one((void **)&m->items, m->len, &m->cap, sizeof(Py_ssize_t)) < 0)
        return -1;
    m->items[m->len++] = value;
    return 0;
}

enum verdict { PLAIN, OTHER, TOO_DEEP, TOO_BIG, FAILED };

/* The walk's state: the cost of each value on the unpickler's stack, where its MARKs stand, and the cost each
 * memo index holds (dense while every PUT names an index stored or the next one; after any other, a GET is taken
 * to cost as much as the deepest and the biggest value seen so far). */
typedef struct {
    Costs stack, memo;
    Marks marks;
    Cost most; /* the greatest depth and visits pushed so far: a bound on any value a GET can fetch */
    uint32_t max_depth, max_visits;
    int memo_dense;
    int plain;
    int whole; /* the walk got to the pickle's STOP */
} Walk;

static Py_ssize_t above_mark(const Walk *w)
{
    return w->stack.len - (w->marks.len ? w->marks.items[w->marks.len - 1] : 0);
}

/* The top `count` values as one: the deepest depth, and the visits summed (to one past max_visits at most). */
static Cost sum_of_top(const Walk *w, Py_ssize_t count)
{
    Cost sum = {0, 0};
    uint64_t visits = 0;
    for (Py_ssize_t i = w->stack.len - count; i < w->stack.len; i++) {
        sum.depth = w->stack.items[i].depth > sum.depth ? w->stack.items[i].depth : sum.depth;
        visits += w->stack.items[i].visits;
    }
    sum.visits = visits > (uint64_t)w->max_visits ? w->max_visits + 1 : (uint32_t)visits;
    return sum;
}

/* Replace the top `count` values by one of `cost`; -1 on failure. */
static int replace_top(Walk *w, Py_ssize_t count, Cost cost)
{
    w->stack.len -= count;
    w->most.depth = cost.depth > w->most.depth ? cost.depth : w->most.depth;
    w->most.visits = cost.visits > w->most.visits ? cost.visits : w->most.visits;
    return costs_push(&w->stack, cost);
}

static const Cost LEAF = {0, 1};

/* A tuple of the top `count` values: one deeper than the deepest, its own visit and theirs; 1 to go on, -2 for a
 * tuple nested past max_depth, -3 for one whose hash visits more than max_visits items, -1 on failure. */
static int make_tuple(Walk *w, Py_ssize_t count)
{
    Cost cost = sum_of_top(w, count);
    cost.depth++;
    cost.visits += cost.visits <= w->max_visits;
    if (cost.depth > w->max_depth)
        return -2;
    if (cost.visits > w->max_visits)
        return -3;
    return replace_top(w, count, cost) < 0 ? -1 : 1;
}

/* Apply one opcode's effect on the costs: 1 to go on, 0 where either unpickler would stop here (underflow, a GET
 * of an index never PUT), make_tuple's -2 and -3, -1 on failure. */
static int step(Walk *w, const uint8_t *p)
{
    Py_ssize_t above = above_mark(w);
    switch (*p) {
    case 't': case 0x85: case 0x86: case 0x87: { /* TUPLE, TUPLE1-3 */
        Py_ssize_t count = *p == 't' ? above : *p - 0x84;
        if (*p == 't') {
            if (!w->marks.len)
                return 0;
            w->marks.len--;
        } else if (above < count) {
            return 0;
        }
        return make_tuple(w, count);
    }
    case ')':
        return make_tuple(w, 0);
    case '(':
        return marks_push(&w->marks, w->stack.len) < 0 ? -1 : 1;
    case 'a': case 's': /* APPEND, SETITEM: items go into a list or dict, which no hash walks into */
        if (above < (*p == 'a' ? 2 : 3))
            return 0;
        w->stack.len -= *p == 'a' ? 1 : 2;
        return 1;
    case 'e': case 'u': case 0x90: /* APPENDS, SETITEMS, ADDITEMS: up to the MARK, into the value below it */
        if (!w->marks.len)
            return 0;
        w->stack.len = w->marks.items[--w->marks.len];
        return above_mark(w) >= 1;
    case 'R': case 0x81: case 'b': case 0x93: /* REDUCE, NEWOBJ, BUILD, STACK_GLOBAL: as costly as their operands */
        if (above < 2)
            return 0;
        return replace_top(w, 2, sum_of_top(w, 2)) < 0 ? -1 : 1;
    case 'Q': /* BINPERSID */
        return above >= 1;
    case 'q': case 'r': case 0x94: { /* BINPUT, LONG_BINPUT, MEMOIZE */
        if (above < 1)
            return 0;
        uint64_t index = *p == 'q' ? p[1] : *p == 'r' ? le32(p + 1) : (uint64_t)w->memo.len;
        if (!w->memo_dense || index > (uint64_t)w->memo.len) { /* Python's pickler makes no gap */
            w->memo_dense = 0;
            w->plain = 0;
            return 1;
        }
        Cost top = w->stack.items[w->stack.len - 1];
        if (index < (uint64_t)w->memo.len) {
            w->memo.items[index] = top;
            return 1;
        }
        return costs_push(&w->memo, top) < 0 ? -1 : 1;
    }
    case 'h': case 'j': { /* BINGET, LONG_BINGET */
        uint64_t index = *p == 'h' ? p[1] : le32(p + 1);
        if (w->memo_dense && index >= (uint64_t)w->memo.len)
            return 0;
        return costs_push(&w->stack, w->memo_dense ? w->memo.items[index] : w->most) < 0 ? -1 : 1;
    }
    case '.': case 0x80: case 0x95: /* STOP (the caller ends there), PROTO, FRAME */
        return 1;
    default: /* every other opcode either reader runs pushes a value that nests nothing */
        return replace_top(w, 0, LEAF) < 0 ? -1 : 1;
    }
}

/* The loop: each opcode the table lets either reader run, up to STOP or where both readers would stop.
 * `*at` is left where the walk ended: one past the STOP, or at the opcode it went no further than. */
static enum verdict walk_opcodes(Walk *w, const uint8_t *p, const uint8_t *end, const uint8_t *table,
                                 const uint8_t **at)
{
    for (*at = p; p < end && table[*p]; *at = p) {
        Py_ssize_t n = arg_length(p, end);
        if (n < 0)
            return OTHER;
        w->plain &= table[*p] == 1 && (*p != 0x80 || p[1] == 2); /* protocol 2 only, as torch's reader */
        if (*p == '.') {
            *at = p + 1;
            w->whole = 1;
            return w->plain ? PLAIN : OTHER;
        }
        int stepped = step(w, p);
        if (stepped <= 0)
            return stepped == 0 ? OTHER : stepped == -2 ? TOO_DEEP : stepped == -3 ? TOO_BIG : FAILED;
        p += 1 + n;
    }
    return OTHER;
}

/* The verdict on the pickle that starts at `start` in `data`; with `with_end` (walk_from), also the offset where
 * the walk ended (one past the pickle's STOP, or the opcode it went no further than) and whether at a STOP. */
static PyObject *walk_at(PyObject *args, int with_end)
{
    static const char *const answers[] = {"plain", "other", "too deep", "too big"};
    Py_buffer data, table;
    unsigned int max_depth, max_visits;
    Py_ssize_t start = 0, ended = 0;
    int whole = 0;
    if (!PyArg_ParseTuple(args, with_end ? "y*y*IIn" : "y*y*II", &data, &table, &max_depth, &max_visits, &start))
        return NULL;
    enum verdict verdict = OTHER;
    if (table.len != 256 || start < 0 || start > data.len || max_visits >= UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, table.len != 256 ? "the opcode table has 256 entries"
                                          : max_visits >= UINT32_MAX ? "max_visits is below 2**32 - 1"
                                                                     : "the start lies outside the data");
        verdict = FAILED;
    } else {
        const uint8_t *base = data.buf, *p = base + start, *at = p;
        Walk w = {.max_depth = max_depth, .max_visits = max_visits, .memo_dense = 1,
                  .plain = data.len - start >= 2 && p[0] == 0x80 && p[1] == 2};
        verdict = walk_opcodes(&w, p, base + data.len, table.buf, &at);
        ended = at - base;
        whole = w.whole;
        PyMem_Free(w.stack.items);
        PyMem_Free(w.marks.items);
        PyMem_Free(w.memo.items);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&table);
    if (verdict == FAILED)
        return NULL;
    if (!with_end)
        return PyUnicode_FromString(answers[verdict]);
    return Py_BuildValue("(snO)", answers[verdict], ended, whole ? Py_True : Py_False);
}

static PyObject *walk(PyObject *self, PyObject *args)
{
    return walk_at(args, 0);
}

static PyObject *walk_from(PyObject *self, PyObject *args)
{
    return walk_at(args, 1);
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS,
     "walk(data, table, max_depth, max_visits) -> 'plain', 'other', 'too deep' (a tuple nested past max_depth) "
     "or 'too big' (a tuple whose hash visits more than max_visits items)."},
    {"walk_from", walk_from, METH_VARARGS,
     "walk_from(data, table, max_depth, max_visits, start) -> (verdict, end, whole): walk's verdict on the "
     "pickle at `start` of a stream of pickles, where the walk ended (one past the STOP, or the opcode it went no further than) and "
     "whether it got to the STOP."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickscan(void)
{
    return PyModule_Create(&module);
}
