/* Composing elements from their byte planes: shared by _planes.c (interleave) and _huffman.c
 * (decode_chain). Header-only, so that each extension module stays one file. */
#ifndef CKPT_INTERLEAVE_H
#define CKPT_INTERLEAVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_simd.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDS_LITTLE_ENDIAN 1
#else
#define WORDS_LITTLE_ENDIAN 0
#endif

/* out[i * width + j] = planes[j][i] for every element i and byte j. */
static CKPT_AVX2_CLONE __attribute__((noinline, unused)) void interleave_planes(uint8_t *out, const uint8_t *const *planes, ptrdiff_t width, ptrdiff_t rows)
{
    if (width == 1) {
        memcpy(out, planes[0], (size_t)rows);
        return;
    }
#if WORDS_LITTLE_ENDIAN
    if (width == 2) {
        const uint8_t *a = planes[0], *b = planes[1];
        for (ptrdiff_t i = 0; i < rows; i++) {
            uint16_t word = (uint16_t)(a[i] | (b[i] << 8));
            memcpy(out + 2 * i, &word, 2);
        }
        return;
    }
    if (width == 4) {
        const uint8_t *a = planes[0], *b = planes[1], *c = planes[2], *d = planes[3];
        for (ptrdiff_t i = 0; i < rows; i++) {
            uint32_t word = (uint32_t)a[i] | ((uint32_t)b[i] << 8) | ((uint32_t)c[i] << 16) | ((uint32_t)d[i] << 24);
            memcpy(out + 4 * i, &word, 4);
        }
        return;
    }
    if (width == 8) {
        for (ptrdiff_t i = 0; i < rows; i++) {
            uint64_t word = 0;
            for (int j = 0; j < 8; j++)
                word |= (uint64_t)planes[j][i] << (8 * j);
            memcpy(out + 8 * i, &word, 8);
        }
        return;
    }
#endif
    for (ptrdiff_t j = 0; j < width; j++) {
        const uint8_t *plane = planes[j];
        uint8_t *column = out + j;
        for (ptrdiff_t i = 0; i < rows; i++)
            column[i * width] = plane[i];
    }
}

#endif
