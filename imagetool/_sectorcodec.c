/* Decoding and hashing a sector in one pass over memory: the compiled half of
 * imagetool.format's decode_stored_into and checksum_and_blocks (which fall back to
 * python-zstandard and python-xxhash where this module was not built).
 *
 * A cold read spends most of its own CPU on three passes over each 4 MiB sector:
 * decompressing it, hashing it whole (xxh3-128, the index's checksum) and hashing each
 * 16 KiB block of it (xxh3-64, the node cache's per-block digests). A 4 MiB sector does
 * not fit in a core's L2, so each hash after the decompression reads it back from memory.
 * Here the sector is decompressed a slice at a time, straight into the caller's buffer
 * (zstd's stable output buffer: no copy through a window), and each slice is hashed both
 * ways while it is still in the CPU's cache. The interpreter lock is released throughout.
 *
 * Libraries: libzstd and libxxhash (Debian's libzstd-dev, libxxhash-dev); xxh3 through
 * libxxhash's x86 dispatch, which picks AVX2 or AVX-512 at run time where the CPU has it.
 * The digests are xxhash's canonical (big-endian) forms, as python-xxhash's digest()s.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_d_stableOutBuffer */
#include <zstd.h>
#include <zstd_errors.h>

#include <pthread.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

/* Compressed bytes given to the decoder at a time: each call decodes a few blocks
 * (128 KiB of output each at most), which are hashed before the next call. */
#define IN_STEP (64 * 1024)
/* Bytes hashed at a time by hash_blocks. */
#define HASH_STEP (256 * 1024)

typedef struct {
    XXH3_state_t *whole;
    const unsigned char *base;
    size_t hashed;          /* bytes of base hashed whole so far */
    size_t blocked;         /* bytes of base whose blocks are digested so far */
    size_t block;           /* 0: no block digests */
    unsigned char *digests; /* 8 bytes per block */
    size_t ndigests;
} hasher;

/* whole: also hash all of it (xxh3-128). */
static int hasher_init(hasher *h, const void *base, size_t size, size_t block, int whole) {
    h->whole = NULL;
    if (whole) {
        h->whole = XXH3_createState();
        if (h->whole == NULL || XXH3_128bits_reset(h->whole) == XXH_ERROR) {
            return -1;
        }
    }
    h->base = base;
    h->hashed = h->blocked = 0;
    h->block = block;
    h->ndigests = 0;
    h->digests = NULL;
    if (block) {
        size_t most = size / block + 1;
        h->digests = PyMem_RawMalloc(most * 8 + 1);
        if (h->digests == NULL) {
            return -1;
        }
    }
    return 0;
}

static void hasher_free(hasher *h) {
    if (h->whole) XXH3_freeState(h->whole);
    PyMem_RawFree(h->digests);
}

/* Hash base[hashed, upto) whole, and digest the blocks that end at or before upto (all of
 * them, the last one short, when final). */
static void hasher_advance(hasher *h, size_t upto, int final) {
    if (upto > h->hashed && h->whole != NULL) {
        XXH3_128bits_update(h->whole, h->base + h->hashed, upto - h->hashed);
        h->hashed = upto;
    }
    if (!h->block) return;
    while (h->blocked + h->block <= upto || (final && h->blocked < upto)) {
        size_t n = upto - h->blocked < h->block ? upto - h->blocked : h->block;
        XXH64_canonical_t c;
        XXH64_canonicalFromHash(&c, XXH3_64bits(h->base + h->blocked, n));
        memcpy(h->digests + 8 * h->ndigests++, c.digest, 8);
        h->blocked += n;
    }
}

/* (checksum, digests), preceded by produced when produced >= 0. */
static PyObject *hasher_result(hasher *h, Py_ssize_t produced) {
    XXH128_canonical_t c;
    Py_ssize_t clen = 0;
    if (h->whole != NULL) {
        XXH128_canonicalFromHash(&c, XXH3_128bits_digest(h->whole));
        clen = (Py_ssize_t)sizeof(c.digest);
    }
    const char *digests = h->digests ? (const char *)h->digests : "";
    Py_ssize_t n = (Py_ssize_t)(8 * h->ndigests);
    if (produced >= 0) {
        return Py_BuildValue("ny#y#", produced, (const char *)c.digest, clen, digests, n);
    }
    return Py_BuildValue("y#y#", (const char *)c.digest, clen, digests, n);
}

static int block_arg(Py_ssize_t block) {
    if (block < 0) {
        PyErr_SetString(PyExc_ValueError, "negative block size");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_into_doc,
"decode_into(stored, out, block) -> (produced, checksum, digests)\n\n"
"Decompress the first zstd frame of ``stored`` into the writable buffer ``out``. "
"``produced``: the bytes it decoded to, len(out) + 1 if more than fit; ``checksum``: the "
"xxh3-128 of the bytes written to ``out`` (16 bytes, canonical); ``digests``: with "
"``block`` > 0, the xxh3-64 of each ``block``-byte block of them (8 bytes each). "
"ValueError: not zstd data, or corrupt.");

/* Decompression contexts kept for reuse: a new one costs its allocation and setup on every
 * sector, and sectors are decoded on threads that come and go (one per store read). */
#define KEPT_DCTX 8
static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;
static ZSTD_DCtx *kept[KEPT_DCTX];
static int nkept;

static ZSTD_DCtx *take_dctx(void) {
    ZSTD_DCtx *d = NULL;
    pthread_mutex_lock(&kept_mu);
    if (nkept > 0) d = kept[--nkept];
    pthread_mutex_unlock(&kept_mu);
    if (d == NULL) return ZSTD_createDCtx();
    ZSTD_DCtx_reset(d, ZSTD_reset_session_and_parameters);
    return d;
}

static void give_dctx(ZSTD_DCtx *d) {
    if (d == NULL) return;
    pthread_mutex_lock(&kept_mu);
    if (nkept < KEPT_DCTX) {
        kept[nkept++] = d;
        d = NULL;
    }
    pthread_mutex_unlock(&kept_mu);
    ZSTD_freeDCtx(d);
}

static PyObject *decode_into(PyObject *self, PyObject *args) {
    Py_buffer in, out;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "y*w*n", &in, &out, &block)) return NULL;
    PyObject *result = NULL;
    hasher h = {0};
    ZSTD_DCtx *dctx = NULL;
    size_t err = 0, produced = 0;
    int longer = 0, nomem = 0;
    if (block_arg(block) < 0) goto done;

    Py_BEGIN_ALLOW_THREADS
    dctx = take_dctx();
    if (dctx == NULL || hasher_init(&h, out.buf, (size_t)out.len, (size_t)block, 1) < 0) {
        nomem = 1;
    } else {
        ZSTD_DCtx_setParameter(dctx, ZSTD_d_stableOutBuffer, 1);
        ZSTD_outBuffer o = {out.buf, (size_t)out.len, 0};
        ZSTD_inBuffer i = {in.buf, 0, 0};
        size_t total = (size_t)in.len;
        for (;;) {
            size_t was_in = i.pos, was_out = o.pos;
            if (i.size < total) i.size = total - i.size > IN_STEP ? i.size + IN_STEP : total;
            size_t r = ZSTD_decompressStream(dctx, &o, &i);
            if (ZSTD_isError(r)) {
                if (ZSTD_getErrorCode(r) == ZSTD_error_dstSize_tooSmall) longer = 1;
                else err = r;
                break;
            }
            hasher_advance(&h, o.pos, 0);
            if (r == 0) {
                /* The frame is whole: anything after it is not this sector's. */
                longer = i.pos != total;
                break;
            }
            if (i.pos == was_in && o.pos == was_out && i.size == total) {
                /* no progress with all input given: a full buffer, or a truncated frame */
                longer = o.pos == o.size;
                break;
            }
        }
        hasher_advance(&h, o.pos, 1);
        produced = longer ? (size_t)out.len + 1 : o.pos;
    }
    Py_END_ALLOW_THREADS

    if (nomem) {
        PyErr_NoMemory();
    } else if (err) {
        PyErr_Format(PyExc_ValueError, "zstd: %s", ZSTD_getErrorName(err));
    } else {
        result = hasher_result(&h, (Py_ssize_t)produced);
    }
done:
    give_dctx(dctx);
    hasher_free(&h);
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(hash_blocks_doc,
"hash_blocks(data, block, whole=True) -> (checksum, digests)\n\n"
"The xxh3-128 of ``data`` (16 bytes, canonical; b\"\" unless ``whole``) and, with "
"``block`` > 0, the xxh3-64 of each ``block``-byte block of it (8 bytes each), the last "
"one short: in one pass.");

static PyObject *hash_blocks(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t block;
    int whole = 1;
    if (!PyArg_ParseTuple(args, "y*n|p", &data, &block, &whole)) return NULL;
    PyObject *result = NULL;
    hasher h = {0};
    int nomem = 0;
    if (block_arg(block) < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    if (hasher_init(&h, data.buf, (size_t)data.len, (size_t)block, whole) < 0) {
        nomem = 1;
    } else {
        size_t size = (size_t)data.len;
        for (size_t at = 0; at < size;) {
            at = size - at > HASH_STEP ? at + HASH_STEP : size;
            hasher_advance(&h, at, at == size);
        }
    }
    Py_END_ALLOW_THREADS
    if (nomem) PyErr_NoMemory();
    else result = hasher_result(&h, -1);
done:
    hasher_free(&h);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_into", decode_into, METH_VARARGS, decode_into_doc},
    {"hash_blocks", hash_blocks, METH_VARARGS, hash_blocks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "imagetool._sectorcodec",
    "Decoding and hashing a sector in one pass over memory (see imagetool.format).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sectorcodec(void) { return PyModule_Create(&module); }
