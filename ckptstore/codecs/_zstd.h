/* zstd frames decoded from C without the GIL, through the system's libzstd loaded at run time.
 *
 * The chain decoder (_huffman.c) used to decline chunks with a zstd plane, and the Python path then
 * made a dozen calls per chunk: small tensors' chunks (most of a checkpoint's chunks, a few KB each)
 * cost 28 us each that way. No headers or link-time dependency are needed: the few stable-API
 * functions are looked up in libzstd.so.1 (libzstd.1.dylib on macOS) when the module loads; where
 * it is missing, ckpt_zstd_ready() is 0 and those chunks keep the Python path (python-zstandard).
 * Each thread keeps one decompression context, freed when the thread exits.
 */
#ifndef CKPT_ZSTD_H
#define CKPT_ZSTD_H

#include <stddef.h>
#include <stdio.h>

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>

typedef struct ZSTD_DCtx_s ZSTD_DCtx;

static struct {
    ZSTD_DCtx *(*create)(void);
    size_t (*free)(ZSTD_DCtx *);
    size_t (*decompress)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
    size_t (*frame_size)(const void *, size_t);
    unsigned (*is_error)(size_t);
    const char *(*error_name)(size_t);
    pthread_key_t context;
    int ready;
} zstd_lib;

static void ckpt_zstd_free_context(void *context) { zstd_lib.free(context); }

/* Look libzstd up once, at module load (under the import lock); 1 when it is usable. */
static int ckpt_zstd_load(void)
{
    const char *names[] = {"libzstd.so.1", "libzstd.1.dylib", "libzstd.so"};
    void *lib = NULL;
    for (size_t i = 0; !lib && i < sizeof names / sizeof *names; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return 0;
    *(void **)&zstd_lib.create = dlsym(lib, "ZSTD_createDCtx");
    *(void **)&zstd_lib.free = dlsym(lib, "ZSTD_freeDCtx");
    *(void **)&zstd_lib.decompress = dlsym(lib, "ZSTD_decompressDCtx");
    *(void **)&zstd_lib.frame_size = dlsym(lib, "ZSTD_findFrameCompressedSize");
    *(void **)&zstd_lib.is_error = dlsym(lib, "ZSTD_isError");
    *(void **)&zstd_lib.error_name = dlsym(lib, "ZSTD_getErrorName");
    if (!zstd_lib.create || !zstd_lib.free || !zstd_lib.decompress || !zstd_lib.frame_size ||
        !zstd_lib.is_error || !zstd_lib.error_name || pthread_key_create(&zstd_lib.context, ckpt_zstd_free_context))
        return 0;
    zstd_lib.ready = 1;
    return 1;
}

static int ckpt_zstd_ready(void) { return zstd_lib.ready; }

/* Decompress the single zstd frame src[0:size] into exactly `rows` bytes at dst; NULL, or what is
 * wrong in `why`. A frame that holds more or fewer bytes, or bytes after the frame, is damage. */
static const char *ckpt_zstd_frame(const void *src, size_t size, void *dst, size_t rows, char *why, size_t why_size)
{
    ZSTD_DCtx *context = pthread_getspecific(zstd_lib.context);
    if (!context) {
        context = zstd_lib.create();
        if (!context || pthread_setspecific(zstd_lib.context, context)) {
            if (context)
                zstd_lib.free(context);
            return "out of memory for a zstd context";
        }
    }
    size_t framed = zstd_lib.frame_size(src, size);
    if (zstd_lib.is_error(framed)) {
        snprintf(why, why_size, "%s", zstd_lib.error_name(framed));
        return why;
    }
    if (framed != size) {
        snprintf(why, why_size, "%zu bytes follow the frame", size - framed);
        return why;
    }
    size_t got = zstd_lib.decompress(context, dst, rows, src, size);
    if (zstd_lib.is_error(got)) {
        snprintf(why, why_size, "%s (expected %zu bytes)", zstd_lib.error_name(got), rows);
        return why;
    }
    if (got != rows) {
        snprintf(why, why_size, "decompresses to %zu bytes, expected %zu", got, rows);
        return why;
    }
    return NULL;
}

#else
static int ckpt_zstd_load(void) { return 0; }
static int ckpt_zstd_ready(void) { return 0; }
static const char *ckpt_zstd_frame(const void *src, size_t size, void *dst, size_t rows, char *why, size_t why_size)
{
    (void)src, (void)size, (void)dst, (void)rows, (void)why, (void)why_size;
    return "zstd is not available";
}
#endif

#endif
