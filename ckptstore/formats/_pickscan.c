/* A walk over a pickle's opcodes that runs nothing: may the C unpickler load it? (formats/torchzip.py)
 *
 * The restricted reader runs torch.save's data.pkl on the pure-Python unpickler, whose dispatch
 * table holds only the opcodes torch's weights_only loader implements. The C unpickler is about
 * faster but runs every opcode it knows, and sizes its memo by the largest index a PUT
 * names (LONG_BINPUT 0xffffffff would ask for 32 GiB). This walk says yes only to a protocol-2
 * pickle whose every opcode up to STOP is in `allowed` (a 256-byte table made in Python from the
 * same opcode set), with every argument inside the data and every PUT's memo index one already
 * stored or the next one (as Python's pickler numbers them: the memo then grows by one entry per
 * PUT of a new index, each a distinct opcode, not with a PUT repeated, which a deflated zip entry
 * packs a thousand to the byte, nor with bytes after STOP);
 * anything else is read by the Python unpickler exactly as before. Opcodes whose argument layout
 * this file does not know are refused whatever `allowed` says.
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
    case 0x8f: case 'Q':
        return 0;
    case 0x80: /* PROTO: only 2, as the Python reader's load_proto */
        return left >= 1 && arg[0] == 2 ? 1 : -1;
    case 'K': case 'h': case 'q': /* BININT1, BINGET, BINPUT: one byte */
        return left >= 1 ? 1 : -1;
    case 'M':
        return left >= 2 ? 2 : -1;
    case 'J': case 'j': case 'r':
        return left >= 4 ? 4 : -1;
    case 'G':
        return left >= 8 ? 8 : -1;
    case 'U': case 0x8a: /* SHORT_BINSTRING, LONG1: a length byte */
        return left >= 1 && left - 1 >= arg[0] ? 1 + arg[0] : -1;
    case 'X': /* BINUNICODE: a 4-byte length */
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

static PyObject *plain(PyObject *self, PyObject *args)
{
    Py_buffer data, allowed;
    if (!PyArg_ParseTuple(args, "y*y*", &data, &allowed))
        return NULL;
    int ok = 0;
    if (allowed.len == 256 && data.len >= 2) {
        const uint8_t *p = data.buf, *end = p + data.len, *table = allowed.buf;
        uint64_t next_index = 0; /* one past the highest memo index a PUT stored so far */
        ok = p[0] == 0x80 && p[1] == 2;
        p += 2;
        while (ok) {
            if (p >= end || !table[*p]) {
                ok = 0;
                break;
            }
            if (*p == '.')
                break;
            Py_ssize_t n = arg_length(p, end);
            ok = n >= 0;
            if (ok && (*p == 'q' || *p == 'r')) { /* the C memo grows to twice the index a PUT names */
                uint64_t index = *p == 'q' ? p[1] : le32(p + 1);
                ok = index <= next_index;
                next_index += index == next_index;
            }
            p += 1 + (n > 0 ? n : 0);
        }
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&allowed);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"plain", plain, METH_VARARGS,
     "plain(data, allowed) -> bool: a protocol-2 pickle of allowed opcodes only, arguments in bounds, up to STOP."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickscan(void)
{
    return PyModule_Create(&module);
}
