/* Hot loops of the lossy codecs, without the GIL: packing and unpacking k-bit codes, counting
 * symbols, and bfloat16 rounding.
 *
 * Each replaces several numpy passes (a table gather, a cast, an add, a compare; or four integer
 * passes for a rounding) by one, and lets a second thread work meanwhile. entropy.py and floats.py
 * keep the numpy versions as fallback and as the reference the tests compare these with, bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_simd.h"

/* HOLDS_ESCAPE[w][byte]: whether the byte holds an all-ones code, for widths 1, 2, 4, 8 (w 0-3). */
static uint8_t HOLDS_ESCAPE[4][256];

static void fill_escape_tables(void)
{
    for (int w = 0; w < 4; w++) {
        int width = 1 << w, per = 8 / width, mask = (1 << width) - 1;
        for (int byte = 0; byte < 256; byte++)
            for (int k = 0; k < per; k++)
                if (((byte >> (k * width)) & mask) == mask)
                    HOLDS_ESCAPE[w][byte] = 1;
    }
}

/* code + low in T's arithmetic, wrapping for integers as numpy's add does: a damaged `low` near the
 * type's limit must not overflow a signed int (undefined behaviour; found by scripts/fuzz_asan.sh). */
static inline int32_t add_i32(int32_t code, int32_t low) { return (int32_t)((uint32_t)code + (uint32_t)low); }
static inline int64_t add_i64(int64_t code, int64_t low) { return (int64_t)((uint64_t)code + (uint64_t)low); }
static inline float add_f32(float code, float low) { return code + low; }
static inline double add_f64(double code, double low) { return code + low; }

/* out[i] = (T)code_i + (T)low, the codes `width` bits each, little-endian within a byte. Positions
 * of the escape code (all ones) go to `positions`, up to `room` of them; returns how many there were.
 * (T)code + (T)low in T's arithmetic is what numpy's cast-then-add computes, to the bit. */
#define UNPACK(T, WIDTH)                                                                            \
    static Py_ssize_t unpack_##T##_##WIDTH(const uint8_t *raw, Py_ssize_t count, T low, T *out,     \
                                           int64_t *positions, Py_ssize_t room)                     \
    {                                                                                               \
        enum { PER = 8 / (WIDTH), MASK = (1 << (WIDTH)) - 1 };                                      \
        Py_ssize_t whole = count / PER, escapes = 0;                                                \
        for (Py_ssize_t j = 0; j < whole; j++) { /* PER is a constant: unrolled, vectorized */       \
            unsigned byte = raw[j];                                                                 \
            for (int k = 0; k < PER; k++)                                                           \
                out[j * PER + k] = add_##T((T)((byte >> (k * (WIDTH))) & MASK), low);               \
        }                                                                                           \
        for (Py_ssize_t i = whole * PER; i < count; i++)                                            \
            out[i] = add_##T((T)((raw[whole] >> ((i - whole * PER) * (WIDTH))) & MASK), low);        \
        for (Py_ssize_t j = 0; j < (count + PER - 1) / PER; j++) { /* skim: most bytes hold none */  \
            unsigned byte = raw[j];                                                                 \
            if (!HOLDS_ESCAPE[(WIDTH) == 8 ? 3 : (WIDTH) / 2][byte])                                \
                continue;                                                                           \
            for (int k = 0; k < PER; k++) {                                                         \
                Py_ssize_t i = j * PER + k;                                                         \
                if (((byte >> (k * (WIDTH))) & MASK) == MASK && i < count) {                       \
                    if (escapes < room)                                                             \
                        positions[escapes] = i;                                                     \
                    escapes++;                                                                      \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        return escapes;                                                                             \
    }

#define UNPACK_ALL_WIDTHS(T) UNPACK(T, 1) UNPACK(T, 2) UNPACK(T, 4) UNPACK(T, 8)

typedef int32_t i32;
typedef int64_t i64;
typedef float f32;
typedef double f64;
UNPACK_ALL_WIDTHS(i32)
UNPACK_ALL_WIDTHS(i64)
UNPACK_ALL_WIDTHS(f32)
UNPACK_ALL_WIDTHS(f64)

#define DISPATCH_WIDTH(T)                                                                           \
    switch (width) {                                                                                \
    case 1: found = unpack_##T##_1(raw, count, (T)low, (T *)out.buf, pos, room); break;            \
    case 2: found = unpack_##T##_2(raw, count, (T)low, (T *)out.buf, pos, room); break;            \
    case 4: found = unpack_##T##_4(raw, count, (T)low, (T *)out.buf, pos, room); break;            \
    default: found = unpack_##T##_8(raw, count, (T)low, (T *)out.buf, pos, room); break;           \
    }

static CKPT_AVX2_CLONE PyObject *py_unpack_codes(PyObject *self, PyObject *args)
{
    Py_buffer packed, out, positions;
    int width, kind;
    long long low;
    if (!PyArg_ParseTuple(args, "y*iLw*Cw*:unpack_codes", &packed, &width, &low, &out, &kind, &positions))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t size = kind == 'i' || kind == 'f' ? 4 : kind == 'q' || kind == 'd' ? 8 : 0;
    if (size == 0 || (width != 1 && width != 2 && width != 4 && width != 8)) {
        PyErr_SetString(PyExc_ValueError, "unpack_codes: kind is one of i, q, f, d and width 1, 2, 4 or 8");
        goto done;
    }
    Py_ssize_t count = out.len / size, per = 8 / width;
    if (out.len % size || packed.len < (count + per - 1) / per) {
        PyErr_SetString(PyExc_ValueError, "unpack_codes: packed codes are short");
        goto done;
    }
    const uint8_t *raw = (const uint8_t *)packed.buf;
    int64_t *pos = (int64_t *)positions.buf;
    Py_ssize_t room = positions.len / 8, found = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case 'i': DISPATCH_WIDTH(i32) break;
    case 'q': DISPATCH_WIDTH(i64) break;
    case 'f': DISPATCH_WIDTH(f32) break;
    default: DISPATCH_WIDTH(f64) break;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(found);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&out);
    PyBuffer_Release(&positions);
    return result;
}

/* Codes of WIDTH bits for symbols (s - low), packed little-endian within a byte; a symbol outside
 * [low, low + 2**WIDTH - 1) gets the all-ones escape code and its value goes to `escaped`, which
 * has room for `count` values (written without branching). Returns how many symbols escaped. */
#define PACK_WIDTH(T, WIDTH)                                                                        \
    static Py_ssize_t pack_##T##_##WIDTH(const T *symbols, Py_ssize_t count, int64_t low,           \
                                         uint8_t *packed, int64_t *escaped)                         \
    {                                                                                               \
        enum { PER = 8 / (WIDTH), ESCAPE = (1 << (WIDTH)) - 1 };                                    \
        Py_ssize_t escapes = 0;                                                                     \
        for (Py_ssize_t j = 0; j * PER < count; j++) {                                              \
            unsigned byte = 0;                                                                      \
            for (int k = 0; k < PER && j * PER + k < count; k++) {                                  \
                int64_t value = (int64_t)symbols[j * PER + k];                                      \
                uint64_t offset = (uint64_t)(value - low);                                          \
                uint64_t code = offset < ESCAPE ? offset : ESCAPE;                                  \
                escaped[escapes] = value;                                                           \
                escapes += code == ESCAPE;                                                          \
                byte |= (unsigned)code << (k * (WIDTH));                                            \
            }                                                                                       \
            packed[j] = (uint8_t)byte;                                                              \
        }                                                                                           \
        return escapes;                                                                             \
    }

#define PACK(T)                                                                                     \
    PACK_WIDTH(T, 1) PACK_WIDTH(T, 2) PACK_WIDTH(T, 4) PACK_WIDTH(T, 8)                             \
    static Py_ssize_t pack_##T(const T *symbols, Py_ssize_t count, int width, int64_t low,          \
                               uint8_t *packed, int64_t *escaped)                                   \
    {                                                                                               \
        switch (width) {                                                                            \
        case 1: return pack_##T##_1(symbols, count, low, packed, escaped);                          \
        case 2: return pack_##T##_2(symbols, count, low, packed, escaped);                          \
        case 4: return pack_##T##_4(symbols, count, low, packed, escaped);                          \
        default: return pack_##T##_8(symbols, count, low, packed, escaped);                         \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* counts[s - low] += 1 for each symbol; all must lie in [low, low + bins). Narrow streams count \
     * into four tables, so that runs of one value do not wait on one counter. */                   \
    static void count_##T(const T *symbols, Py_ssize_t count, int64_t low, int64_t *counts,          \
                          Py_ssize_t bins)                                                          \
    {                                                                                               \
        Py_ssize_t i = 0;                                                                           \
        if (bins <= SPLIT_COUNT_BINS) {                                                             \
            static _Thread_local int64_t split[3][SPLIT_COUNT_BINS];                                \
            for (int t = 0; t < 3; t++)                                                             \
                memset(split[t], 0, sizeof(split[t][0]) * (size_t)bins);                            \
            for (; i + 4 <= count; i += 4) {                                                        \
                counts[(int64_t)symbols[i] - low]++;                                                \
                split[0][(int64_t)symbols[i + 1] - low]++;                                          \
                split[1][(int64_t)symbols[i + 2] - low]++;                                          \
                split[2][(int64_t)symbols[i + 3] - low]++;                                          \
            }                                                                                       \
            for (Py_ssize_t b = 0; b < bins; b++)                                                   \
                counts[b] += split[0][b] + split[1][b] + split[2][b];                               \
        }                                                                                           \
        for (; i < count; i++)                                                                      \
            counts[(int64_t)symbols[i] - low]++;                                                    \
    }

#define SPLIT_COUNT_BINS 4096
typedef int8_t i8;
typedef int16_t i16;
PACK(i8)
PACK(i16)
PACK(i32)
PACK(i64)

static Py_ssize_t symbol_size(int kind)
{
    return kind == 'b' ? 1 : kind == 'h' ? 2 : kind == 'i' ? 4 : kind == 'q' ? 8 : 0;
}

static CKPT_AVX2_CLONE PyObject *py_pack_codes(PyObject *self, PyObject *args)
{
    Py_buffer symbols, packed, escaped;
    int width, kind;
    long long low;
    if (!PyArg_ParseTuple(args, "y*CiLw*w*:pack_codes", &symbols, &kind, &width, &low, &packed, &escaped))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t size = symbol_size(kind);
    if (size == 0 || (width != 1 && width != 2 && width != 4 && width != 8)) {
        PyErr_SetString(PyExc_ValueError, "pack_codes: kind is one of b, h, i, q and width 1, 2, 4 or 8");
        goto done;
    }
    Py_ssize_t count = symbols.len / size, per = 8 / width;
    if (symbols.len % size || packed.len != (count + per - 1) / per) {
        PyErr_SetString(PyExc_ValueError, "pack_codes: packed must hold ceil(count * width / 8) bytes");
        goto done;
    }
    if (escaped.len / 8 < count) {
        PyErr_SetString(PyExc_ValueError, "pack_codes: escaped must have room for every symbol");
        goto done;
    }
    Py_ssize_t found = 0;
    uint8_t *out = (uint8_t *)packed.buf;
    int64_t *values = (int64_t *)escaped.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case 'b': found = pack_i8((const i8 *)symbols.buf, count, width, low, out, values); break;
    case 'h': found = pack_i16((const i16 *)symbols.buf, count, width, low, out, values); break;
    case 'i': found = pack_i32((const i32 *)symbols.buf, count, width, low, out, values); break;
    default: found = pack_i64((const i64 *)symbols.buf, count, width, low, out, values); break;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(found);
done:
    PyBuffer_Release(&symbols);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&escaped);
    return result;
}

static CKPT_AVX2_CLONE PyObject *py_count_symbols(PyObject *self, PyObject *args)
{
    Py_buffer symbols, counts;
    int kind;
    long long low;
    if (!PyArg_ParseTuple(args, "y*CLw*:count_symbols", &symbols, &kind, &low, &counts))
        return NULL;
    Py_ssize_t size = symbol_size(kind);
    if (size == 0 || symbols.len % size) {
        PyErr_SetString(PyExc_ValueError, "count_symbols: kind is one of b, h, i, q");
    } else {
        Py_BEGIN_ALLOW_THREADS
        memset(counts.buf, 0, (size_t)counts.len);
        switch (kind) {
        case 'b': count_i8((const i8 *)symbols.buf, symbols.len, low, (int64_t *)counts.buf, counts.len / 8); break;
        case 'h': count_i16((const i16 *)symbols.buf, symbols.len / 2, low, (int64_t *)counts.buf, counts.len / 8); break;
        case 'i': count_i32((const i32 *)symbols.buf, symbols.len / 4, low, (int64_t *)counts.buf, counts.len / 8); break;
        default: count_i64((const i64 *)symbols.buf, symbols.len / 8, low, (int64_t *)counts.buf, counts.len / 8); break;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&symbols);
    PyBuffer_Release(&counts);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* The float32 bit pattern `bits` rounded to the nearest bfloat16 (ties to even), as its top half;
 * a NaN stays a quiet NaN. */
static inline uint32_t bfloat16_half(uint32_t bits)
{
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return (bits >> 16) | 0x40u;
    return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

static CKPT_AVX2_CLONE PyObject *py_round_bfloat16(PyObject *self, PyObject *args)
{
    Py_buffer values;
    if (!PyArg_ParseTuple(args, "w*:round_bfloat16", &values))
        return NULL;
    uint32_t *bits = (uint32_t *)values.buf;
    Py_ssize_t count = values.len / 4;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        bits[i] = bfloat16_half(bits[i]) << 16;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&values);
    Py_RETURN_NONE;
}

static CKPT_AVX2_CLONE PyObject *py_to_bfloat16(PyObject *self, PyObject *args)
{
    Py_buffer values, out;
    if (!PyArg_ParseTuple(args, "y*w*:to_bfloat16", &values, &out))
        return NULL;
    PyObject *result = NULL;
    if (out.len * 2 != values.len) {
        PyErr_SetString(PyExc_ValueError, "to_bfloat16: out must hold 2 bytes per float32");
    } else {
        const uint32_t *bits = (const uint32_t *)values.buf;
        uint16_t *halves = (uint16_t *)out.buf;
        Py_ssize_t count = values.len / 4;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            halves[i] = (uint16_t)bfloat16_half(bits[i]);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_codes", py_pack_codes, METH_VARARGS,
     "pack_codes(symbols, kind, width, low, packed, escaped) -> how many symbols escaped (escaped: room for all)."},
    {"count_symbols", py_count_symbols, METH_VARARGS,
     "count_symbols(symbols, kind, low, counts): counts[s - low] = occurrences; every s must fit."},
    {"unpack_codes", py_unpack_codes, METH_VARARGS,
     "unpack_codes(packed, width, low, out, kind, positions) -> escapes: out[i] = code_i + low."},
    {"round_bfloat16", py_round_bfloat16, METH_VARARGS, "round_bfloat16(float32 values): in place."},
    {"to_bfloat16", py_to_bfloat16, METH_VARARGS, "to_bfloat16(float32 values, uint16 out)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lossy", "Hot loops of the lossy codecs.", -1, methods};

PyMODINIT_FUNC PyInit__lossy(void)
{
    fill_escape_tables();
    return PyModule_Create(&module);
}
