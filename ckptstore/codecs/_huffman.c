/* Order-0 Huffman coding of byte planes, decoded several symbols per table lookup, without the GIL.
 *
 * zstd decodes the exponent planes of float checkpoints at 1-1.5 GB/s on our machines, and those
 * planes are most of a lossless checkout's work. Their symbols are short (2-3 bits on average), so
 * one lookup in a table indexed by the next MAXBITS bits yields up to four whole symbols; four
 * independent streams keep the CPU busy while each lookup waits on the previous one.
 *
 * Payload:
 *   128 bytes: the code length of each of the 256 byte values, 4 bits each (low nibble first,
 *              0 = absent); the lengths must form a complete prefix code of at most MAXBITS bits;
 *   u64 (little-endian): rows, the number of bytes coded;
 *   STREAMS x u32 (little-endian): the byte length of each stream;
 *   the streams: stream s codes rows [s * seg, min((s + 1) * seg, rows)), seg = ceil(rows / STREAMS),
 *              each code least significant bit first (canonical codes, bit-reversed);
 *   PAD zero bytes, so that a 64-bit load at any position inside the streams stays in the payload.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#include "_interleave.h"
#include "_zstd.h"

#define MAXBITS 11
#define TABLE_SIZE (1u << MAXBITS)
#define TABLE_MASK (TABLE_SIZE - 1)
#define STREAMS 4 /* decode_bulk is written out for four */
#define LENGTHS_BYTES 128
#define ROWS_AT LENGTHS_BYTES
#define SIZES_AT (ROWS_AT + 8)
#define HEAD_BYTES (SIZES_AT + 4 * STREAMS)
#define PAD 8
#define SYMBOLS_PER_ENTRY 4
#define LOOKUPS_PER_LOAD 4 /* 4 x MAXBITS = 44 of the >= 57 bits one 64-bit load gives */

typedef struct {
    uint32_t symbols; /* up to SYMBOLS_PER_ENTRY decoded bytes, first in the low byte */
    uint8_t count;    /* how many of them are whole */
    uint8_t bits;     /* bits they take together */
    uint8_t first_bits;
    uint8_t unused;
} entry_t;

static inline uint64_t load64le(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store32le(uint8_t *p, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

static inline uint32_t load32le(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Unpack and check the code lengths: each at most MAXBITS, together a complete prefix code. */
static int read_lengths(const uint8_t *packed, uint8_t *lengths)
{
    uint32_t kraft = 0;
    for (int i = 0; i < 256; i++) {
        uint8_t length = (packed[i / 2] >> (4 * (i & 1))) & 15;
        if (length > MAXBITS)
            return -1;
        lengths[i] = length;
        if (length)
            kraft += TABLE_SIZE >> length;
    }
    return kraft == TABLE_SIZE ? 0 : -1;
}

/* Canonical codes (shorter first, then by byte value), bit-reversed for LSB-first streams. */
static void canonical_codes(const uint8_t *lengths, uint16_t *codes)
{
    uint32_t per_length[MAXBITS + 1] = {0}, next[MAXBITS + 1] = {0}, code = 0;
    for (int s = 0; s < 256; s++)
        per_length[lengths[s]]++;
    per_length[0] = 0;
    for (int bits = 1; bits <= MAXBITS; bits++) {
        code = (code + per_length[bits - 1]) << 1;
        next[bits] = code;
    }
    for (int s = 0; s < 256; s++) {
        if (!lengths[s])
            continue;
        uint32_t c = next[lengths[s]]++, reversed = 0;
        for (int b = 0; b < lengths[s]; b++)
            reversed |= ((c >> b) & 1u) << (lengths[s] - 1 - b);
        codes[s] = (uint16_t)reversed;
    }
}

/* For every MAXBITS-bit window, the whole symbols it starts with (up to SYMBOLS_PER_ENTRY). */
static void build_table(const uint8_t *lengths, entry_t *table)
{
    uint16_t codes[256];
    uint8_t first_symbol[TABLE_SIZE], first_length[TABLE_SIZE];
    canonical_codes(lengths, codes);
    for (int s = 0; s < 256; s++)
        for (uint32_t w = lengths[s] ? codes[s] : TABLE_SIZE; w < TABLE_SIZE; w += 1u << lengths[s]) {
            first_symbol[w] = (uint8_t)s;
            first_length[w] = lengths[s];
        }
    for (uint32_t w = 0; w < TABLE_SIZE; w++) {
        entry_t e = {0, 0, 0, first_length[w], 0};
        while (e.count < SYMBOLS_PER_ENTRY) {
            uint32_t rest = w >> e.bits; /* bits past the window read as 0: valid only if the code fits */
            if (first_length[rest] > MAXBITS - e.bits)
                break;
            e.symbols |= (uint32_t)first_symbol[rest] << (8 * e.count);
            e.bits += first_length[rest];
            e.count++;
        }
        table[w] = e;
    }
}

static inline void put64le(uint8_t *p, uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* Code `n` bytes as one LSB-first stream at dst; returns its size (the last byte padded with zeros).
 * Four codes (at most 4 * MAXBITS = 44 bits, on top of at most 7 pending) are added between
 * flushes, and each flush stores 8 bytes and keeps the unfinished byte: no branch on how full
 * the buffer is, which the CPU mispredicted every few symbols. A flush may write up to 7 bytes
 * past the stream's end; whatever is coded next (the next stream, or encode's padding) overwrites them. */
static size_t encode_stream(const uint8_t *src, size_t n, const uint16_t *codes, const uint8_t *lengths, uint8_t *dst)
{
    uint32_t table[256]; /* code in the low 16 bits, length above: one lookup per symbol */
    for (int s = 0; s < 256; s++)
        table[s] = (uint32_t)codes[s] | (uint32_t)lengths[s] << 16;
    uint64_t acc = 0;
    unsigned fill = 0;
    uint8_t *p = dst;
    size_t i = 0;
#define ADD_SYMBOL(symbol)                                  \
    do {                                                    \
        uint32_t e = table[(symbol)];                       \
        acc |= (uint64_t)(e & 0xffff) << fill;              \
        fill += e >> 16;                                    \
    } while (0)
#define FLUSH()                                             \
    do {                                                    \
        put64le(p, acc);                                    \
        p += fill >> 3;                                     \
        acc >>= fill & 56;                                  \
        fill &= 7;                                          \
    } while (0)
    for (; i + 4 <= n; i += 4) {
        ADD_SYMBOL(src[i]);
        ADD_SYMBOL(src[i + 1]);
        ADD_SYMBOL(src[i + 2]);
        ADD_SYMBOL(src[i + 3]);
        FLUSH();
    }
    for (; i < n; i++) {
        ADD_SYMBOL(src[i]);
        FLUSH();
    }
#undef ADD_SYMBOL
#undef FLUSH
    if (fill)
        *p++ = (uint8_t)acc;
    return (size_t)(p - dst);
}

static size_t segment(size_t rows) { return (rows + STREAMS - 1) / STREAMS; }

static size_t encoded_bound(size_t rows)
{
    return HEAD_BYTES + STREAMS * ((segment(rows) * MAXBITS + 7) / 8) + PAD;
}

static void histogram(const uint8_t *src, size_t rows, uint64_t *counts)
{
    uint64_t partial[4][256] = {{0}}; /* four tables, so that runs of one byte do not serialize on one counter */
    size_t i = 0;
    for (; i + 4 <= rows; i += 4) {
        partial[0][src[i]]++;
        partial[1][src[i + 1]]++;
        partial[2][src[i + 2]]++;
        partial[3][src[i + 3]]++;
    }
    for (; i < rows; i++)
        partial[0][src[i]]++;
    for (int s = 0; s < 256; s++)
        counts[s] = partial[0][s] + partial[1][s] + partial[2][s] + partial[3][s];
}

/* Huffman code lengths of at most MAXBITS bits for the byte counts (two-queue construction).
 * Where the optimal code is deeper, counts are halved (keeping each at least 1) until it fits,
 * which only lengthens the codes of rare bytes. A lone byte (or none) gets a one-bit code next
 * to an unused one, so the code is always complete. */
static void code_lengths(const uint64_t *counts_in, uint8_t *lengths)
{
    uint64_t counts[256], weight[512];
    int order[256], parent[512], depth[512];
    memcpy(counts, counts_in, sizeof counts);
    for (;;) {
        int n = 0;
        for (int s = 0; s < 256; s++)
            if (counts[s]) {
                int k = n++;
                for (; k > 0 && counts[order[k - 1]] > counts[s]; k--)
                    order[k] = order[k - 1];
                order[k] = s;
            }
        memset(lengths, 0, 256);
        if (n <= 1) {
            int lone = n ? order[0] : 0;
            lengths[lone] = lengths[(lone + 1) & 255] = 1;
            return;
        }
        for (int i = 0; i < n; i++)
            weight[i] = counts[order[i]];
        int leaf = 0, node = n, created = n;
        for (int k = 0; k < n - 1; k++, created++) {
            int pick[2];
            for (int j = 0; j < 2; j++)
                pick[j] = leaf < n && (node >= created || weight[leaf] <= weight[node]) ? leaf++ : node++;
            weight[created] = weight[pick[0]] + weight[pick[1]];
            parent[pick[0]] = parent[pick[1]] = created;
        }
        int deepest = 0;
        depth[2 * n - 2] = 0;
        for (int i = 2 * n - 3; i >= 0; i--)
            depth[i] = depth[parent[i]] + 1;
        for (int i = 0; i < n; i++) {
            lengths[order[i]] = (uint8_t)depth[i];
            deepest = depth[i] > deepest ? depth[i] : deepest;
        }
        if (deepest <= MAXBITS)
            return;
        for (int s = 0; s < 256; s++)
            if (counts[s])
                counts[s] = counts[s] > 1 ? counts[s] >> 1 : 1;
    }
}

static void pack_lengths(const uint8_t *lengths, uint8_t *packed)
{
    for (int i = 0; i < LENGTHS_BYTES; i++)
        packed[i] = (uint8_t)(lengths[2 * i] | (lengths[2 * i + 1] << 4));
}

/* The payload's size for `rows` bytes with these counts and lengths (each stream rounded up to bytes, at most). */
static size_t coded_size(const uint64_t *counts, const uint8_t *lengths)
{
    uint64_t bits = 0;
    for (int s = 0; s < 256; s++)
        bits += counts[s] * lengths[s];
    return HEAD_BYTES + (size_t)((bits + 7) / 8) + STREAMS + PAD;
}

/* Encode `rows` bytes into dst (encoded_bound(rows) bytes, at least); returns the payload's size. */
static size_t encode(const uint8_t *src, size_t rows, uint8_t *dst)
{
    uint64_t counts[256];
    uint8_t lengths[256];
    uint16_t codes[256];
    histogram(src, rows, counts);
    code_lengths(counts, lengths);
    canonical_codes(lengths, codes);
    pack_lengths(lengths, dst);
    store32le(dst + ROWS_AT, (uint32_t)rows);
    store32le(dst + ROWS_AT + 4, (uint32_t)((uint64_t)rows >> 32));
    size_t seg = segment(rows), written = HEAD_BYTES;
    for (int s = 0; s < STREAMS; s++) {
        size_t start = seg * s < rows ? seg * s : rows, stop = seg * (s + 1) < rows ? seg * (s + 1) : rows;
        size_t size = encode_stream(src + start, stop - start, codes, lengths, dst + written);
        store32le(dst + SIZES_AT + 4 * s, (uint32_t)size);
        written += size;
    }
    memset(dst + written, 0, PAD);
    return written + PAD;
}

typedef struct {
    uint64_t bit;  /* next bit to read, from the start of the payload */
    uint64_t stop; /* first bit past this stream */
    uint8_t *out, *out_end;
} cursor_t;

/* One lookup of lane i: its next symbols stored (up to four bytes, `count` of them whole), its bit
 * position and window advanced. */
#define STEP(i)                                        \
    do {                                               \
        entry_t e = table[w##i & TABLE_MASK];          \
        store32le(o##i, e.symbols);                    \
        o##i += e.count;                               \
        b##i += e.bits;                                \
        w##i >>= e.bits;                               \
    } while (0)
#define ROOM (LOOKUPS_PER_LOAD * SYMBOLS_PER_ENTRY + 3) /* output bytes the widest load's steps may store */
#define HAS_ROOM(c, o, b) ((c)->out_end - (o) >= ROOM && (b) <= last_load)
#define LOAD(i) (load64le(payload + (b##i >> 3)) >> (b##i & 7))

/* The bulk of decoding: four streams at once, four lookups per 64-bit load, while every stream
 * has room for the widest step and its next load stays inside the payload. Locals and restrict
 * pointers tell the compiler that the output stores touch neither the table nor the cursors. */
static void decode_bulk(const uint8_t *payload, const entry_t *restrict table, cursor_t *cursors, uint64_t last_load)
{
    uint8_t *restrict o0 = cursors[0].out, *restrict o1 = cursors[1].out;
    uint8_t *restrict o2 = cursors[2].out, *restrict o3 = cursors[3].out;
    uint64_t b0 = cursors[0].bit, b1 = cursors[1].bit, b2 = cursors[2].bit, b3 = cursors[3].bit;
    while (HAS_ROOM(&cursors[0], o0, b0) && HAS_ROOM(&cursors[1], o1, b1) && HAS_ROOM(&cursors[2], o2, b2) &&
           HAS_ROOM(&cursors[3], o3, b3)) {
        uint64_t w0 = LOAD(0), w1 = LOAD(1), w2 = LOAD(2), w3 = LOAD(3);
        for (int k = 0; k < LOOKUPS_PER_LOAD; k++) {
            STEP(0);
            STEP(1);
            STEP(2);
            STEP(3);
        }
    }
    cursors[0].out = o0, cursors[1].out = o1, cursors[2].out = o2, cursors[3].out = o3;
    cursors[0].bit = b0, cursors[1].bit = b1, cursors[2].bit = b2, cursors[3].bit = b3;
}

/* Two streams at once (y may be NULL: x alone), as decode_bulk, until one of them runs out of room. */
static void decode_two(const uint8_t *payload, const entry_t *restrict table, cursor_t *x, cursor_t *y,
                       uint64_t last_load)
{
    uint8_t *restrict o0 = x->out;
    uint64_t b0 = x->bit;
    if (!y) {
        while (HAS_ROOM(x, o0, b0)) {
            uint64_t w0 = LOAD(0);
            for (int k = 0; k < LOOKUPS_PER_LOAD; k++)
                STEP(0);
        }
    } else {
        uint8_t *restrict o1 = y->out;
        uint64_t b1 = y->bit;
        while (HAS_ROOM(x, o0, b0) && HAS_ROOM(y, o1, b1)) {
            uint64_t w0 = LOAD(0), w1 = LOAD(1);
            for (int k = 0; k < LOOKUPS_PER_LOAD; k++) {
                STEP(0);
                STEP(1);
            }
        }
        y->out = o1, y->bit = b1;
    }
    x->out = o0, x->bit = b0;
}

/* The streams decode_bulk left with room, two at a time: the four streams of an exponent plane
 * whose parts differ in entropy (weights, then moments) decode at different rates, and when the
 * fastest runs out the others have up to three quarters of their rows left, which one symbol
 * per lookup decoded at half the speed. */
static void decode_rest(const uint8_t *payload, const entry_t *restrict table, cursor_t *cursors, uint64_t last_load)
{
    for (;;) {
        cursor_t *left[STREAMS];
        int n = 0;
        for (int s = 0; s < STREAMS; s++)
            if (HAS_ROOM(&cursors[s], cursors[s].out, cursors[s].bit))
                left[n++] = &cursors[s];
        if (!n)
            return;
        decode_two(payload, table, left[0], n > 1 ? left[1] : NULL, last_load);
    }
}
#undef STEP
#undef ROOM
#undef HAS_ROOM
#undef LOAD

/* Decode `payload` into rows bytes at out; returns NULL or what is wrong with the payload. */
static const char *decode(const uint8_t *payload, size_t size, uint8_t *out, size_t rows)
{
    uint8_t lengths[256];
    entry_t table[TABLE_SIZE];
    cursor_t cursors[STREAMS];
    if (size < HEAD_BYTES + PAD)
        return "payload is shorter than its header";
    if (read_lengths(payload, lengths) < 0)
        return "code lengths do not form a complete code";
    if ((load32le(payload + ROWS_AT) | ((uint64_t)load32le(payload + ROWS_AT + 4) << 32)) != (uint64_t)rows)
        return "payload holds a different number of bytes than its destination";
    size_t seg = segment(rows);
    uint64_t offset = HEAD_BYTES;
    for (int s = 0; s < STREAMS; s++) {
        size_t start = seg * s < rows ? seg * s : rows, stop = seg * (s + 1) < rows ? seg * (s + 1) : rows;
        uint64_t bytes = load32le(payload + SIZES_AT + 4 * s);
        cursors[s] = (cursor_t){8 * offset, 8 * (offset + bytes), out + start, out + stop};
        offset += bytes;
    }
    if (offset + PAD != size)
        return "stream lengths do not add up to the payload's size";
    build_table(lengths, table);
    const uint64_t last_load = 8 * (uint64_t)(size - 8); /* a load at a bit <= this stays inside */

    decode_bulk(payload, table, cursors, last_load);
    decode_rest(payload, table, cursors, last_load);
    for (int s = 0; s < STREAMS; s++) {
        cursor_t *c = &cursors[s];
        while (c->out < c->out_end) {
            if (c->bit > last_load)
                return "a stream runs past the payload";
            entry_t e = table[(load64le(payload + (c->bit >> 3)) >> (c->bit & 7)) & TABLE_MASK];
            *c->out++ = (uint8_t)e.symbols;
            c->bit += e.first_bits;
        }
        if (c->bit > c->stop)
            return "a stream decodes past its end";
    }
    return NULL;
}

/* Zero-run coding of a mostly-zero plane (the XOR of an exponent plane with its parent's, where
 * 90-95% of bytes are 0): Huffman costs at least a bit per zero there, and zstd little less.
 * The plane becomes two byte streams, each Huffman-coded as above: gap tokens (the zeros before
 * each nonzero byte, 255 standing for 255 zeros without a byte after them) and the nonzero bytes.
 * Trailing zeros are implied. Decoding touches only the nonzero bytes, so it can XOR them into a
 * base plane in place.
 *
 * Payload: RUNS_HEAD bytes: u64 rows, u64 nonzero count, u64 token count, u64 gap payload size
 * (little-endian); the gap tokens' Huffman payload; the nonzero bytes' Huffman payload. */
#define RUNS_HEAD 32
#define RUN_TOKEN 255

static inline void store64le(uint8_t *p, uint64_t v)
{
    store32le(p, (uint32_t)v);
    store32le(p + 4, (uint32_t)(v >> 32));
}

/* Split a plane into its gap tokens and nonzero bytes: gaps needs runs_scratch(rows) bytes and
 * values rows + 1 (each gets one scratch byte past its end). Returns the token count; *nonzero the
 * byte count. Branch-light: a nonzero byte is stored unconditionally and counted by adding its
 * flag (XOR planes are 5-50% nonzero, where a branch per byte mispredicts), and 8 zero bytes in a
 * row are skipped in one test. The tokens are exactly those of the byte-by-byte definition. */
static size_t split_runs(const uint8_t *src, size_t rows, uint8_t *gaps, uint8_t *values, size_t *nonzero)
{
    size_t k = 0, j = 0, last = 0, i = 0; /* last: the position after the previous nonzero byte */
    while (i < rows) {
        if (i + 8 <= rows && !load64le(src + i)) {
            i += 8;
            continue;
        }
        size_t stop = i + 8 <= rows ? i + 8 : rows;
        for (; i < stop; i++) {
            uint8_t b = src[i];
            size_t gap = i - last, flag = b != 0;
            if ((gap >= RUN_TOKEN) & flag) { /* rare: a run of 255 zeros or more before a byte */
                for (; gap >= RUN_TOKEN; gap -= RUN_TOKEN)
                    gaps[k++] = RUN_TOKEN;
            }
            gaps[k] = (uint8_t)gap;
            values[j] = b;
            k += flag;
            j += flag;
            last = flag ? i + 1 : last;
        }
    }
    *nonzero = j;
    return k;
}

static size_t runs_scratch(size_t rows) { return rows + rows / RUN_TOKEN + 2; }

/* This thread's buffer of at least `size` bytes, kept between calls (freed when the thread exits); NULL
 * without memory. A plane's gaps and bytes were malloc'ed and freed per call: glibc maps blocks that
 * large afresh and unmaps them on free (or trims them off the heap), so every call faulted in new pages,
 * and where a checkout keeps its tensors nothing else hands them back: a zero-run level then cost
 * 1.9 ns/byte of its chunk against 0.6 once the buffer was kept (bench.level_cost). */
typedef struct {
    uint8_t *data;
    size_t size;
} scratch_t;

/* Under AddressSanitizer each call gets a buffer of exactly its size, so that a read or write past it is
 * seen (a kept, larger buffer hid them); elsewhere one larger than SCRATCH_KEEP_MAX goes at the next call. */
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SCRATCH_EXACT 1
#endif
#endif
#if !defined(SCRATCH_EXACT) && defined(__SANITIZE_ADDRESS__)
#define SCRATCH_EXACT 1
#endif
#ifndef SCRATCH_EXACT
#define SCRATCH_EXACT 0
#endif
#define SCRATCH_KEEP_MAX ((size_t)32 << 20) /* a 4 MiB chunk's plane needs about 8 MiB at most */

static pthread_key_t scratch_key;
static int scratch_key_made; /* 0: not yet, 1: made, -1: pthread_key_create failed (every call: NULL) */
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *kept)
{
    free(((scratch_t *)kept)->data);
    free(kept);
}

static void scratch_make_key(void) { scratch_key_made = pthread_key_create(&scratch_key, scratch_free) ? -1 : 1; }

static uint8_t *thread_scratch(size_t size)
{
    pthread_once(&scratch_once, scratch_make_key);
    if (scratch_key_made < 0)
        return NULL;
    scratch_t *kept = pthread_getspecific(scratch_key);
    if (!kept) {
        if (!(kept = calloc(1, sizeof *kept)) || pthread_setspecific(scratch_key, kept)) {
            free(kept);
            return NULL;
        }
    }
    if (kept->size < size || (kept->size > size && (SCRATCH_EXACT || kept->size > SCRATCH_KEEP_MAX))) {
        free(kept->data);
        kept->size = (kept->data = malloc(size)) ? size : 0;
    }
    return kept->data;
}

static size_t runs_bound(size_t rows) { return RUNS_HEAD + 2 * encoded_bound(rows); }

/* Encode a plane's zero runs into dst (runs_bound(rows) bytes at least); returns the size, or 0 without memory. */
static size_t encode_runs(const uint8_t *src, size_t rows, uint8_t *dst)
{
    uint8_t *gaps = thread_scratch(runs_scratch(rows) + rows + 1);
    if (!gaps)
        return 0;
    uint8_t *values = gaps + runs_scratch(rows);
    size_t n, t = split_runs(src, rows, gaps, values, &n);
    size_t gap_size = encode(gaps, t, dst + RUNS_HEAD);
    size_t value_size = encode(values, n, dst + RUNS_HEAD + gap_size);
    store64le(dst, rows);
    store64le(dst + 8, n);
    store64le(dst + 16, t);
    store64le(dst + 24, gap_size);
    return RUNS_HEAD + gap_size + value_size;
}

/* The size encode_runs would write for a plane (within 2 * STREAMS bytes), without coding it;
 * 0 without memory. */
static size_t runs_size(const uint8_t *src, size_t rows)
{
    uint64_t gap_counts[256], value_counts[256];
    uint8_t lengths[256];
    uint8_t *gaps = thread_scratch(runs_scratch(rows) + rows + 1);
    if (!gaps)
        return 0;
    uint8_t *values = gaps + runs_scratch(rows);
    size_t n, t = split_runs(src, rows, gaps, values, &n), size = RUNS_HEAD;
    histogram(gaps, t, gap_counts);
    histogram(values, n, value_counts);
    code_lengths(gap_counts, lengths);
    size += coded_size(gap_counts, lengths);
    code_lengths(value_counts, lengths);
    return size + coded_size(value_counts, lengths);
}

/* Whether any of the eight bytes in x is RUN_TOKEN (0xff): the classic zero-byte test on ~x. */
static inline int has_run_token(uint64_t x)
{
    uint64_t y = ~x;
    return ((y - 0x0101010101010101ull) & ~y & 0x8080808080808080ull) != 0;
}

/* Decode a zero-run payload into rows bytes at out, or XOR it into them; NULL or what is wrong. */
static const char *decode_runs(const uint8_t *payload, size_t size, uint8_t *out, size_t rows, int xor)
{
    if (size < RUNS_HEAD)
        return "zero-run payload is shorter than its header";
    uint64_t stated = load64le(payload), n = load64le(payload + 8), t = load64le(payload + 16);
    uint64_t gap_size = load64le(payload + 24);
    if (stated != (uint64_t)rows)
        return "zero-run payload holds a different number of bytes than its destination";
    if (n > rows || t > rows || n > t || gap_size > size - RUNS_HEAD)
        return "zero-run counts do not fit the plane";
    uint8_t *gaps = thread_scratch((size_t)(t + n + 1));
    if (!gaps)
        return "out of memory";
    uint8_t *values = gaps + t;
    const char *problem = decode(payload + RUNS_HEAD, (size_t)gap_size, gaps, (size_t)t);
    if (!problem)
        problem = decode(payload + RUNS_HEAD + gap_size, size - RUNS_HEAD - (size_t)gap_size, values, (size_t)n);
    if (!problem) {
        if (!xor)
            memset(out, 0, rows);
        size_t pos = 0, j = 0, k = 0;
        while (k < t) {
            /* eight tokens at a time where none is a run token and none can reach past the plane, and
             * one at a time, checked, where one is (then eight at a time again) */
            while (k + 8 <= t && j + 8 <= n && pos + 8 * (RUN_TOKEN + 1) <= rows &&
                   !has_run_token(load64le(gaps + k))) {
                for (int i = 0; i < 8; i++) {
                    pos += gaps[k + i];
                    out[pos++] ^= values[j + i];
                }
                k += 8;
                j += 8;
            }
            if (k == t)
                break;
            pos += gaps[k];
            if (gaps[k++] == RUN_TOKEN)
                continue;
            if (pos >= rows || j >= n) {
                problem = "zero-run gaps run past the plane";
                break;
            }
            out[pos++] ^= values[j++];
        }
        if (!problem && (j != n || pos > rows))
            problem = "zero-run tokens and bytes do not match";
    }
    return problem;
}

/* A plane coded by `coder` into a new bytes object (bound(rows) bytes, trimmed); `name` for errors. */
static PyObject *encode_plane(PyObject *args, const char *format, const char *name, size_t (*bound)(size_t),
                              size_t (*coder)(const uint8_t *, size_t, uint8_t *))
{
    Py_buffer src;
    if (!PyArg_ParseTuple(args, format, &src))
        return NULL;
    PyObject *result = NULL;
    if ((size_t)src.len / STREAMS >= UINT32_MAX / MAXBITS) {
        PyErr_Format(PyExc_ValueError, "%s: plane too large for 32-bit stream lengths", name);
    } else if ((result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound((size_t)src.len)))) {
        size_t written;
        Py_BEGIN_ALLOW_THREADS
        written = coder((const uint8_t *)src.buf, (size_t)src.len, (uint8_t *)PyBytes_AS_STRING(result));
        Py_END_ALLOW_THREADS
        if (written) {
            _PyBytes_Resize(&result, (Py_ssize_t)written);
        } else { /* encode_runs could not allocate its streams */
            Py_CLEAR(result);
            PyErr_NoMemory();
        }
    }
    PyBuffer_Release(&src);
    return result;
}

static PyObject *py_encode(PyObject *self, PyObject *args)
{
    return encode_plane(args, "y*:encode", "encode", encoded_bound, encode);
}

/* The size encode would write for a plane (within STREAMS bytes), without coding it. */
static size_t huffman_size(const uint8_t *src, size_t rows)
{
    uint64_t counts[256];
    uint8_t lengths[256];
    histogram(src, rows, counts);
    code_lengths(counts, lengths);
    return coded_size(counts, lengths);
}

/* sizer(plane) without the GIL, as a Python int. */
static PyObject *plane_size(PyObject *args, const char *format, size_t (*sizer)(const uint8_t *, size_t))
{
    Py_buffer src;
    if (!PyArg_ParseTuple(args, format, &src))
        return NULL;
    size_t size;
    Py_BEGIN_ALLOW_THREADS
    size = sizer((const uint8_t *)src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (!size) /* every size has a header: 0 is runs_size without memory */
        return PyErr_NoMemory();
    return PyLong_FromSize_t(size);
}

static PyObject *py_coded_size(PyObject *self, PyObject *args) { return plane_size(args, "y*:coded_size", huffman_size); }

/* decode(payload, out), or with `runs` decode_runs(payload, out, xor): None, or ValueError saying what is wrong. */
static PyObject *decode_plane(PyObject *args, int runs)
{
    Py_buffer payload, out;
    int xor = 0;
    if (runs ? !PyArg_ParseTuple(args, "y*w*p:decode_runs", &payload, &out, &xor)
             : !PyArg_ParseTuple(args, "y*w*:decode", &payload, &out))
        return NULL;
    const char *problem;
    Py_BEGIN_ALLOW_THREADS
    problem = runs ? decode_runs((const uint8_t *)payload.buf, (size_t)payload.len, (uint8_t *)out.buf, (size_t)out.len, xor)
                   : decode((const uint8_t *)payload.buf, (size_t)payload.len, (uint8_t *)out.buf, (size_t)out.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&payload);
    PyBuffer_Release(&out);
    if (problem) {
        PyErr_Format(PyExc_ValueError, "huffman: %s", problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_decode(PyObject *self, PyObject *args) { return decode_plane(args, 0); }

static PyObject *py_encode_runs(PyObject *self, PyObject *args)
{
    return encode_plane(args, "y*:encode_runs", "encode_runs", runs_bound, encode_runs);
}

static PyObject *py_runs_size(PyObject *self, PyObject *args) { return plane_size(args, "y*:runs_size", runs_size); }

static PyObject *py_decode_runs(PyObject *self, PyObject *args) { return decode_plane(args, 1); }

/* A bytegroup chunk rebuilt from its chain in one call (codecs/bytegroup.py has the layout and the
 * Python path it mirrors): per byte plane, the newest level storing it whole is decoded, the XOR
 * levels above it are applied, and the planes are interleaved into the output. zstd planes go
 * through libzstd (_zstd.h); where it was not found, a chain with a needed zstd plane is declined
 * and the Python path (python-zstandard) runs instead. One call per chunk, without the GIL: the
 * Python path made 5-10 calls per chunk and handed the GIL over at each. */
#define BG_HEAD 6
#define BG_PLANE 9
#define BG_MAX_LEVELS 64
#define BG_MAX_WIDTH 16 /* wider elements (none of torch's dtypes) take the Python path */
enum { BG_RAW, BG_ZSTD, BG_XOR_ZSTD, BG_HUF, BG_XOR_HUF, BG_RUNS, BG_XOR_RUNS };

typedef struct {
    int mode;
    size_t offset, length;
} bg_plane_t;

static int bg_is_xor(int mode) { return mode == BG_XOR_ZSTD || mode == BG_XOR_HUF || mode == BG_XOR_RUNS; }

/* Parse one level's header into planes[width]; NULL or what is wrong (the Python path's words). */
static const char *bg_parse(const uint8_t *payload, size_t size, size_t width, bg_plane_t *planes, char *why,
                            size_t why_size)
{
    if (size < BG_HEAD) {
        snprintf(why, why_size, "payload of %zu bytes is truncated", size);
        return why;
    }
    if (memcmp(payload, "BG1", 3) || !payload[3] || (payload[4] | (payload[5] << 8)) != payload[3] ||
        size < BG_HEAD + BG_PLANE * (size_t)payload[3])
        return "payload does not start with a valid header";
    if (payload[3] != width)
        return "chain levels disagree on the element width";
    size_t offset = BG_HEAD + BG_PLANE * width;
    for (size_t j = 0; j < width; j++) {
        const uint8_t *entry = payload + BG_HEAD + BG_PLANE * j;
        uint64_t length = load64le(entry + 1);
        if (entry[0] > BG_XOR_RUNS) {
            snprintf(why, why_size, "plane %zu has unknown mode %u", j, entry[0]);
            return why;
        }
        if (length > size - offset) {
            snprintf(why, why_size, "payload is %zu bytes, header says more", size);
            return why;
        }
        planes[j] = (bg_plane_t){entry[0], offset, (size_t)length};
        offset += (size_t)length;
    }
    if (offset != size) {
        snprintf(why, why_size, "payload is %zu bytes, header says %zu", size, offset);
        return why;
    }
    return NULL;
}

static int bg_is_zstd(int mode) { return mode == BG_ZSTD || mode == BG_XOR_ZSTD; }

/* Decode level `plane` into dst, or XOR it into dst; NULL, or what is wrong, written to `why`. */
static const char *bg_plane_into(const uint8_t *payload, bg_plane_t plane, uint8_t *dst, uint8_t *residual,
                                 size_t rows, int xor, char *why, size_t why_size)
{
    const uint8_t *data = payload + plane.offset;
    char detail[96];
    const char *problem;
    if (plane.mode == BG_RAW) {
        if (plane.length != rows) {
            snprintf(why, why_size, "has %zu bytes, expected %zu", plane.length, rows);
            return why;
        }
        memcpy(dst, data, rows);
        return NULL;
    }
    if (plane.mode == BG_RUNS || plane.mode == BG_XOR_RUNS) { /* zero runs XOR in place */
        problem = decode_runs(data, plane.length, dst, rows, xor);
        if (problem)
            snprintf(why, why_size, "does not decode: huffman: %s", problem);
        return problem ? why : NULL;
    }
    if (bg_is_zstd(plane.mode)) {
        problem = ckpt_zstd_frame(data, plane.length, xor ? residual : dst, rows, detail, sizeof detail);
        if (problem) {
            snprintf(why, why_size, "does not decompress: %s", problem);
            return why;
        }
    } else if ((problem = decode(data, plane.length, xor ? residual : dst, rows))) {
        snprintf(why, why_size, "does not decode: huffman: %s", problem);
        return why;
    }
    if (xor)
        for (size_t i = 0; i < rows; i++)
            dst[i] ^= residual[i];
    return NULL;
}

/* 1: decoded into out; 0: a needed plane is zstd-coded and libzstd was not found (nothing written);
 * -1: damaged, `why` says so. */
static int bg_decode_chain(const uint8_t *const *payloads, const size_t *sizes, size_t levels, uint8_t *out,
                           size_t nbytes, uint8_t *scratch, size_t scratch_size, char *why, size_t why_size)
{
    bg_plane_t layout[BG_MAX_LEVELS][BG_MAX_WIDTH];
    size_t whole[BG_MAX_WIDTH];
    const uint8_t *sources[BG_MAX_WIDTH];
    size_t width = sizes[0] >= BG_HEAD ? payloads[0][3] : 0, rows = width ? nbytes / width : 0;
    if (width > BG_MAX_WIDTH || scratch_size < (width + 1) * rows)
        return 0;
    if (width && nbytes % width) {
        snprintf(why, why_size, "chain levels disagree on the element width");
        return -1;
    }
    for (size_t level = 0; level < levels; level++) {
        const char *problem = bg_parse(payloads[level], sizes[level], width, layout[level], why, why_size);
        if (problem) {
            if (problem != why)
                snprintf(why, why_size, "%s", problem);
            return -1;
        }
    }
    for (size_t j = 0; j < width; j++) {
        size_t level = 0;
        while (level < levels && bg_is_xor(layout[level][j].mode))
            level++;
        if (level == levels) {
            snprintf(why, why_size, "residual chunk decoded without its base");
            return -1;
        }
        whole[j] = level;
        for (size_t k = 0; k <= level && !ckpt_zstd_ready(); k++)
            if (bg_is_zstd(layout[k][j].mode))
                return 0;
    }
    uint8_t *residual = scratch + width * rows;
    for (size_t j = 0; j < width; j++) {
        bg_plane_t top = layout[whole[j]][j];
        if (whole[j] == 0 && top.mode == BG_RAW && top.length == rows) {
            sources[j] = payloads[0] + top.offset; /* read in place */
            continue;
        }
        uint8_t *plane = scratch + j * rows;
        char detail[128];
        const char *problem = bg_plane_into(payloads[whole[j]], top, plane, residual, rows, 0, detail, sizeof detail);
        for (size_t level = whole[j]; !problem && level-- > 0;)
            problem = bg_plane_into(payloads[level], layout[level][j], plane, residual, rows, 1, detail, sizeof detail);
        if (problem) {
            snprintf(why, why_size, "plane %zu %s", j, problem);
            return -1;
        }
        sources[j] = plane;
    }
    interleave_planes(out, sources, (ptrdiff_t)width, (ptrdiff_t)rows);
    return 1;
}

static PyObject *py_decode_chain(PyObject *self, PyObject *args)
{
    PyObject *sequence;
    Py_buffer out, scratch;
    if (!PyArg_ParseTuple(args, "Ow*w*:decode_chain", &sequence, &out, &scratch))
        return NULL;
    PyObject *levels = PySequence_Fast(sequence, "decode_chain: payloads must be a sequence of buffers");
    Py_buffer views[BG_MAX_LEVELS];
    const uint8_t *payloads[BG_MAX_LEVELS];
    size_t sizes[BG_MAX_LEVELS];
    Py_ssize_t count = levels ? PySequence_Fast_GET_SIZE(levels) : 0, held = 0;
    PyObject *result = NULL;
    if (!levels)
        goto release;
    if (count < 1 || count > BG_MAX_LEVELS) {
        result = Py_NewRef(Py_False); /* chains are at most max_chain deep; let the Python path judge */
        goto release;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(levels, held), &views[held], PyBUF_C_CONTIGUOUS) < 0)
            goto release;
        payloads[held] = views[held].buf;
        sizes[held] = (size_t)views[held].len;
    }
    char why[160] = "";
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = bg_decode_chain(payloads, sizes, (size_t)count, out.buf, (size_t)out.len, scratch.buf,
                             (size_t)scratch.len, why, sizeof why);
    Py_END_ALLOW_THREADS
    if (status < 0)
        PyErr_SetString(PyExc_ValueError, why);
    else
        result = PyBool_FromLong(status);
release:
    for (Py_ssize_t k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
    Py_XDECREF(levels);
    PyBuffer_Release(&out);
    PyBuffer_Release(&scratch);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS, "encode(plane) -> payload bytes."},
    {"coded_size", py_coded_size, METH_VARARGS, "coded_size(plane) -> bytes encode would write, at most."},
    {"decode", py_decode, METH_VARARGS, "decode(payload, out): fill out (its size = the plane's) or raise ValueError."},
    {"encode_runs", py_encode_runs, METH_VARARGS, "encode_runs(plane) -> zero-run payload bytes."},
    {"runs_size", py_runs_size, METH_VARARGS, "runs_size(plane) -> bytes encode_runs would write, at most."},
    {"decode_chain", py_decode_chain, METH_VARARGS,
     "decode_chain(payloads, out, scratch) -> True when out holds the chunk; False (nothing written) where the "
     "Python path must decode it (a zstd plane without libzstd, a width over 16, scratch under (width + 1) planes); "
     "ValueError for a damaged chain."},
    {"decode_runs", py_decode_runs, METH_VARARGS,
     "decode_runs(payload, out, xor): fill out, or XOR the plane into it, or raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_huffman", "Multi-symbol Huffman plane coder.", -1, methods};

PyMODINIT_FUNC PyInit__huffman(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "ZSTD", ckpt_zstd_load()) < 0 ||
              PyModule_AddIntConstant(m, "MAXBITS", MAXBITS) < 0 || PyModule_AddIntConstant(m, "STREAMS", STREAMS) < 0 ||
              PyModule_AddIntConstant(m, "PAD", PAD) < 0 || PyModule_AddIntConstant(m, "RUNS_HEAD", RUNS_HEAD) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
