/* FUSE reads answered from sector memory and the node cache without the interpreter: the
 * compiled half of snapshotter.mount.fusewire's request loop (which works without it, in
 * Python alone).
 *
 * A cold sequential pass over an image sends the mount server one FUSE READ per MiB. Four
 * in five of them find their sector already decoded in the reader's memory (fetched
 * ahead); the others find it being fetched. In Python each READ cost the interpreter and
 * its lock: reading the request, mapping it to sectors, waiting for a fetch and taking the
 * lock back after it, the reader's bookkeeping, the profile, the answer. Here a FUSE thread
 * reads requests from /dev/fuse and answers every READ whose sectors are all in ``Memory``
 * (a table of the buffers the reader keeps, which the reader mirrors as it adds and evicts
 * them) with one writev of the header and those buffers, the lock released throughout. A
 * READ of sectors that are being fetched now (``pending``, from the fetcher's workers)
 * waits here, up to ``wait_seconds``, for their ``put`` (woken by the put of the sector it
 * waits for, not by every put). Anything else (another request, a READ of a sector nobody
 * fetches, a wait that ran out) goes back to the Python caller,
 * which handles it as before, deadlines and errors included (``serve`` says how long the
 * READ waited here, so that its deadline counts that wait). The READs answered here are
 * logged; every ``drain_every`` of them the call returns so that the caller hands the log
 * to the reader's bookkeeping (its streams and read-ahead, the startup profile, metrics).
 *
 * A warm mount reads from the node cache instead. Once the reader knows a sector's cache
 * entry's block digests (it evicted the sector from memory after fetching and writing it,
 * a READ answered in Python found the entry whole and checked its trailer, or a new
 * server checked the trailers of the entries the node cache held when it mounted), it gives
 * the table the entry's path and digests (``cached``): a READ of it is then answered here
 * too, the entry opened, the blocks that cover the READ read with direct I/O into this thread's
 * scratch and each checked against its digest (xxh3-64) before anything is written. A
 * block that does not check, or an entry that is gone, hands the READ to Python (which
 * deals with a damaged entry and fetches again) and takes the entry out of the table. A
 * READ no longer than ``disk_min_read`` of an entry goes to Python too, whose read-around
 * windows keep the 128 KiB around a small read in memory for the small reads that follow.
 * An entry a sequential stream is about to read is given ``buffered``: read through the
 * page cache, which the stream's read-ahead fills, and checked the same way.
 *
 * Only verified bytes are answered: the reader puts in the table what it keeps in memory,
 * sectors the fetcher decoded and checked (or zeros), and entries' blocks are checked as
 * they are read. A buffer replaced or dropped while a
 * thread is writing from it stays alive until that write ends (pinned); it is released
 * with the interpreter's lock held, at the next call into this module.
 *
 * The wire format is the kernel's uapi header linux/fuse.h (fuse_in_header,
 * fuse_read_in, fuse_out_header), as in fusewire.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <xxh_x86dispatch.h>
#else
#include <xxhash.h>
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define FUSE_READ 15
#define IN_HEADER 40 /* fuse_in_header */
#define READ_IN 40   /* fuse_read_in */
#define OUT_HEADER 16
#define UNIQUE_RESEND (1ULL << 63)
/* Sectors one READ may span and still be answered here (a 1 MiB READ over 64 KiB sectors
 * spans 17); more go to Python. */
#define MAX_PIECES 32
/* READs waiting for a sector being fetched wait on the condition variable of its stripe
 * (sector number modulo this), so that a sector's arrival wakes the READs that wait for it
 * and not every waiting thread of the connection (a cold stream keeps up to 12 waiting). */
#define WAIT_STRIPES 64

/* What ``serve`` returns (with a byte count). */
enum { ST_REQUEST = 0, ST_DRAIN = 1, ST_ENDED = 2, ST_REPLY_FAILED = 3 };

/* A sector in the table: its bytes in memory (``view``), or in its node cache entry on
 * disk (``path``: opened for each read, read with direct I/O and checked against
 * ``digests`` per ``block``; nothing is held open, so an entry the cache evicts goes). */
typedef struct held {
    Py_buffer view;
    char *path;        /* NULL: in memory */
    uint32_t block;    /* bytes per digest */
    uint64_t *digests; /* xxh3-64 of each block, as numbers */
    int buffered;      /* read through the page cache, not with direct I/O */
    int pins;          /* threads writing from it now */
    int dead;          /* out of the table: release once unpinned */
    struct held *next; /* in the graveyard */
} held;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t arrived[WAIT_STRIPES]; /* a sector of the stripe was put, or its fetch
                                           * ended */
    int mu_ready;
    uint64_t sector_size, image_size, count;
    held **slots;
    unsigned char *pending; /* being fetched now: a READ of it waits here for it */
    uint64_t disk_min_read; /* READs of entries up to this long go to Python */
    long wait_ns;           /* ... at most this long, then goes to Python */
    held *graveyard;     /* dead and unpinned: to release with the lock held */
    uint64_t *log;       /* (offset, length) of each READ answered here, in order */
    size_t log_len, log_cap, drain_every;
    size_t log_reserved; /* entries taken by READs being answered, not logged yet */
    uint64_t disk_reads, disk_failures;
    uint64_t served, served_bytes, resent;
    int64_t in_flight;   /* requests read here and not yet answered or handed over */
} Memory;

/* Mutex held: wake every READ waiting for a fetch. */
static void wake_all(Memory *self) {
    for (int i = 0; i < WAIT_STRIPES; i++) pthread_cond_broadcast(&self->arrived[i]);
}

static uint64_t span_of(Memory *self, uint64_t n) {
    uint64_t start = n * self->sector_size;
    uint64_t left = self->image_size - start;
    return left < self->sector_size ? left : self->sector_size;
}

/* Take ``old`` out of use (mutex held): released now if nobody writes from it, else by
 * the last writer's unpin. Returns it if the caller must release it (after unlocking). */
static held *retire(held *old) {
    if (old == NULL) {
        return NULL;
    }
    old->dead = 1;
    return old->pins == 0 ? old : NULL;
}

/* Mutex held: this thread is done with ``pieces``; those that left the table meanwhile
 * and are now unpinned go to the graveyard, to be released with the interpreter's lock. */
static void unpin(Memory *self, held **pieces, uint64_t count) {
    for (uint64_t i = 0; i < count; i++) {
        held *h = pieces[i];
        if (--h->pins == 0 && h->dead) {
            h->next = self->graveyard;
            self->graveyard = h;
        }
    }
}

/* Free a sector's hold: its buffer (the interpreter's lock is held), or its entry's path
 * and digests. */
static void release_now(held *h) {
    if (h != NULL) {
        if (h->path != NULL) {
            PyMem_RawFree(h->path);
            PyMem_RawFree(h->digests);
        } else {
            PyBuffer_Release(&h->view);
        }
        PyMem_RawFree(h);
    }
}

/* Release what the graveyard holds: the interpreter's lock is held. */
static void bury(Memory *self) {
    held *dead;
    pthread_mutex_lock(&self->mu);
    dead = self->graveyard;
    self->graveyard = NULL;
    pthread_mutex_unlock(&self->mu);
    while (dead != NULL) {
        held *next = dead->next;
        release_now(dead);
        dead = next;
    }
}

/* Take sector n out of the table (only if it is an entry, with ``entries_only``). The
 * interpreter's lock is held. */
static void take_out(Memory *self, uint64_t n, int entries_only) {
    held *old = NULL;
    pthread_mutex_lock(&self->mu);
    held *h = self->slots[n];
    if (h != NULL && (!entries_only || h->path != NULL)) {
        old = retire(h);
        self->slots[n] = NULL;
    }
    pthread_mutex_unlock(&self->mu);
    release_now(old);
}

static int Memory_init(Memory *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"sector_size", "image_size", "drain_every", "log_capacity",
                             "wait_seconds", "disk_min_read", NULL};
    unsigned long long sector_size, image_size, disk_min_read = 0;
    Py_ssize_t drain_every = 4, log_capacity = 4096;
    double wait_seconds = 0.25;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK|nndK", kwlist, &sector_size, &image_size,
                                     &drain_every, &log_capacity, &wait_seconds,
                                     &disk_min_read)) {
        return -1;
    }
    self->disk_min_read = disk_min_read;
    if (!(wait_seconds >= 0 && wait_seconds <= 60)) {
        PyErr_SetString(PyExc_ValueError, "wait_seconds must be within [0, 60]");
        return -1;
    }
    self->wait_ns = (long)(wait_seconds * 1e9);
    if (self->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Memory is initialised once");
        return -1;
    }
    if (sector_size == 0 || drain_every < 1 || log_capacity < drain_every) {
        PyErr_SetString(PyExc_ValueError,
                        "sector_size > 0 and 1 <= drain_every <= log_capacity are required");
        return -1;
    }
    self->sector_size = sector_size;
    self->image_size = image_size;
    self->count = (image_size + sector_size - 1) / sector_size;
    self->slots = PyMem_RawCalloc(self->count ? self->count : 1, sizeof(held *));
    self->pending = PyMem_RawCalloc(self->count ? self->count : 1, 1);
    self->log = PyMem_RawMalloc(2 * (size_t)log_capacity * sizeof(uint64_t));
    if (self->slots == NULL || self->pending == NULL || self->log == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->log_cap = (size_t)log_capacity;
    self->drain_every = (size_t)drain_every;
    pthread_condattr_t attr;
    if (pthread_mutex_init(&self->mu, NULL) != 0 || pthread_condattr_init(&attr) != 0 ||
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot make a mutex and condition variables");
        return -1;
    }
    for (int i = 0; i < WAIT_STRIPES; i++) {
        if (pthread_cond_init(&self->arrived[i], &attr) != 0) {
            while (i-- > 0) pthread_cond_destroy(&self->arrived[i]);
            pthread_condattr_destroy(&attr);
            pthread_mutex_destroy(&self->mu);
            PyErr_SetString(PyExc_OSError, "cannot make a mutex and condition variables");
            return -1;
        }
    }
    pthread_condattr_destroy(&attr);
    self->mu_ready = 1;
    return 0;
}

static void Memory_dealloc(Memory *self) {
    if (self->slots != NULL) {
        for (uint64_t n = 0; n < self->count; n++) {
            release_now(self->slots[n]); /* no serve() runs: it holds a reference */
        }
        PyMem_RawFree(self->slots);
    }
    if (self->mu_ready) {
        bury(self);
        for (int i = 0; i < WAIT_STRIPES; i++) pthread_cond_destroy(&self->arrived[i]);
        pthread_mutex_destroy(&self->mu);
    }
    PyMem_RawFree(self->pending);
    PyMem_RawFree(self->log);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(Memory *self) {
    if (self->slots == NULL || !self->mu_ready) {
        PyErr_SetString(PyExc_RuntimeError, "Memory is not initialised");
        return -1;
    }
    return 0;
}

static int check_sector(Memory *self, unsigned long long n) {
    if (n >= self->count) {
        PyErr_Format(PyExc_IndexError, "sector %llu of %llu", n,
                     (unsigned long long)self->count);
        return -1;
    }
    return 0;
}

/* The one argument of a call about sector ``*n``: -1 with an exception if it is not one. */
static int sector_arg(Memory *self, PyObject *args, unsigned long long *n) {
    if (check_ready(self) < 0 || !PyArg_ParseTuple(args, "K", n) || check_sector(self, *n) < 0) {
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(put_doc, "put(n, buffer): sector n's verified bytes are in ``buffer`` (at least "
                      "the sector's length), until it is dropped or replaced.");

static PyObject *Memory_put(Memory *self, PyObject *args) {
    unsigned long long n;
    PyObject *obj;
    if (check_ready(self) < 0 || !PyArg_ParseTuple(args, "KO", &n, &obj) ||
        check_sector(self, n) < 0) {
        return NULL;
    }
    held *h = PyMem_RawCalloc(1, sizeof(held));
    if (h == NULL) {
        return PyErr_NoMemory();
    }
    if (PyObject_GetBuffer(obj, &h->view, PyBUF_SIMPLE) < 0) {
        PyMem_RawFree(h);
        return NULL;
    }
    Py_ssize_t len = h->view.len;
    if ((uint64_t)len < span_of(self, n)) {
        PyBuffer_Release(&h->view);
        PyMem_RawFree(h);
        return PyErr_Format(PyExc_ValueError, "sector %llu has %llu bytes, the buffer %zd", n,
                            (unsigned long long)span_of(self, n), len);
    }
    pthread_mutex_lock(&self->mu);
    held *old = retire(self->slots[n]);
    self->slots[n] = h;
    self->pending[n] = 0;
    pthread_cond_broadcast(&self->arrived[n % WAIT_STRIPES]);
    pthread_mutex_unlock(&self->mu);
    release_now(old);
    bury(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(cached_doc,
             "cached(n, path, digests, block, buffered=False): sector n is in the node "
             "cache entry at ``path``, its bytes from offset 0, with the xxh3-64 ``digests`` "
             "of each ``block`` (canonical, 8 bytes each, as its trailer has them): a READ "
             "of it opens the entry, reads the blocks it covers with direct I/O (through "
             "the page cache with ``buffered``: a stream's, whose read-ahead fills it) and "
             "checks them. Where the table holds the sector already (memory or an entry), "
             "that stays. Returns whether it was taken.");

static PyObject *Memory_cached(Memory *self, PyObject *args) {
    unsigned long long n;
    const char *path;
    Py_buffer digests;
    unsigned int block;
    int buffered = 0;
    if (check_ready(self) < 0 ||
        !PyArg_ParseTuple(args, "Ksy*I|p", &n, &path, &digests, &block, &buffered)) {
        return NULL;
    }
    if (check_sector(self, n) < 0) {
        PyBuffer_Release(&digests);
        return NULL;
    }
    uint64_t size = span_of(self, n);
    size_t count = block ? (size_t)((size + block - 1) / block) : 0;
    if (block == 0 || block % 4096 || (size_t)digests.len != 8 * count) {
        PyBuffer_Release(&digests);
        return PyErr_Format(PyExc_ValueError,
                            "digests of %llu-byte blocks: %zd bytes for a %llu-byte sector",
                            (unsigned long long)block, digests.len, (unsigned long long)size);
    }
    size_t plen = strlen(path) + 1;
    held *h = PyMem_RawCalloc(1, sizeof(held));
    uint64_t *numbers = PyMem_RawMalloc(count * sizeof(uint64_t));
    char *copy = PyMem_RawMalloc(plen);
    if (h == NULL || numbers == NULL || copy == NULL) {
        PyMem_RawFree(h);
        PyMem_RawFree(numbers);
        PyMem_RawFree(copy);
        PyBuffer_Release(&digests);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < count; i++) {
        XXH64_canonical_t c;
        memcpy(&c, (unsigned char *)digests.buf + 8 * i, 8);
        numbers[i] = XXH64_hashFromCanonical(&c);
    }
    PyBuffer_Release(&digests);
    memcpy(copy, path, plen);
    h->path = copy;
    h->block = block;
    h->digests = numbers;
    h->buffered = buffered;
    int taken = 0;
    pthread_mutex_lock(&self->mu);
    if (self->slots[n] == NULL) {
        self->slots[n] = h;
        taken = 1;
    }
    pthread_mutex_unlock(&self->mu);
    if (!taken) {
        release_now(h);
    }
    return PyBool_FromLong(taken);
}

PyDoc_STRVAR(uncache_doc, "uncache(n): sector n's cache entry is no longer read here (its "
                          "memory, if the table holds that instead, stays).");

static PyObject *Memory_uncache(Memory *self, PyObject *args) {
    unsigned long long n;
    if (sector_arg(self, args, &n) < 0) {
        return NULL;
    }
    take_out(self, n, 1);
    bury(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pending_doc, "pending(n): sector n is being fetched: a READ of it waits for its "
                          "put() (up to wait_seconds) instead of going to Python.");

static PyObject *Memory_pending(Memory *self, PyObject *args) {
    unsigned long long n;
    if (sector_arg(self, args, &n) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&self->mu);
    self->pending[n] = 1;
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(settled_doc, "settled(n): sector n's fetch ended (put() came first if it "
                          "succeeded): READs waiting for it stop waiting.");

static PyObject *Memory_settled(Memory *self, PyObject *args) {
    unsigned long long n;
    if (sector_arg(self, args, &n) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&self->mu);
    if (self->pending[n]) {
        /* The fetch ended without a put (it failed): a READ that waits for another sector
         * first may need this one too, and goes to Python now. Rare: every stripe. */
        self->pending[n] = 0;
        wake_all(self);
    }
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drop_doc, "drop(n): sector n is no longer in memory.");

static PyObject *Memory_drop(Memory *self, PyObject *args) {
    unsigned long long n;
    if (sector_arg(self, args, &n) < 0) {
        return NULL;
    }
    take_out(self, n, 0);
    bury(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(clear_doc, "clear(): no sector is in memory.");

static PyObject *Memory_clear(Memory *self, PyObject *unused) {
    if (check_ready(self) < 0) {
        return NULL;
    }
    for (uint64_t n = 0; n < self->count; n++) {
        take_out(self, n, 0);
    }
    pthread_mutex_lock(&self->mu);
    memset(self->pending, 0, self->count);
    wake_all(self);
    pthread_mutex_unlock(&self->mu);
    bury(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drain_doc, "drain() -> [(offset, length), ...]: the READs answered here since "
                        "the last drain, in the order they were answered.");

static PyObject *Memory_drain(Memory *self, PyObject *unused) {
    if (check_ready(self) < 0) {
        return NULL;
    }
    uint64_t local[2 * 64];
    uint64_t *copy = local;
    size_t len;
    pthread_mutex_lock(&self->mu);
    len = self->log_len;
    if (len > 64) {
        copy = PyMem_RawMalloc(2 * len * sizeof(uint64_t));
        if (copy == NULL) {
            pthread_mutex_unlock(&self->mu);
            return PyErr_NoMemory();
        }
    }
    memcpy(copy, self->log, 2 * len * sizeof(uint64_t));
    self->log_len = 0;
    pthread_mutex_unlock(&self->mu);
    bury(self);
    PyObject *out = PyList_New((Py_ssize_t)len);
    for (size_t i = 0; out != NULL && i < len; i++) {
        PyObject *item = Py_BuildValue("(KK)", (unsigned long long)copy[2 * i],
                                       (unsigned long long)copy[2 * i + 1]);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    if (copy != local) {
        PyMem_RawFree(copy);
    }
    return out;
}

PyDoc_STRVAR(handed_doc, "handed(): the Python caller took over the request ``serve`` "
                         "returned (it counts it in flight from now on).");

static PyObject *Memory_handed(Memory *self, PyObject *unused) {
    __atomic_sub_fetch(&self->in_flight, 1, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* Each FUSE thread's page-aligned memory for the blocks it reads from cache entries. */
static pthread_key_t scratch_key;

typedef struct {
    unsigned char *buf;
    size_t len;
} scratch_t;

static void scratch_free(void *p) {
    scratch_t *s = p;
    free(s->buf);
    free(s);
}

static unsigned char *scratch_of(size_t need) {
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof(scratch_t));
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->len < need) {
        void *p = NULL;
        if (posix_memalign(&p, 4096, need) != 0) {
            return NULL;
        }
        free(s->buf);
        s->buf = p;
        s->len = need;
    }
    return s->buf;
}

/* Read the blocks of an entry that cover [lo, hi) of its sector into ``into`` (aligned)
 * and check each against its digest; the offset of ``lo`` in ``into``, or -1. */
static ssize_t read_checked(held *h, uint64_t size, uint64_t lo, uint64_t hi,
                            unsigned char *into) {
    uint64_t b = h->block;
    uint64_t from = lo / b * b;
    uint64_t to = (hi + b - 1) / b * b;
    if (to > size) {
        to = size;
    }
    size_t len = (size_t)((to - from + 4095) / 4096 * 4096);
    int fd = open(h->path, O_RDONLY | O_CLOEXEC | (h->buffered ? 0 : O_DIRECT));
    if (fd < 0) {
        return -1; /* evicted, or no direct I/O here: Python reads it its own way */
    }
    size_t done = 0;
    while (done < to - from) {
        ssize_t r = pread(fd, into + done, len - done, (off_t)(from + done));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            close(fd);
            return -1; /* an error, or the entry shorter than its trailer says */
        }
        done += (size_t)r;
    }
    close(fd);
    for (uint64_t at = from; at < to; at += b) {
        uint64_t n = size - at < b ? size - at : b;
        if (XXH3_64bits(into + (at - from), (size_t)n) != h->digests[at / b]) {
            return -1;
        }
    }
    return (ssize_t)(lo - from);
}

/* Mutex held: whether sectors [first, first+count) are all in the table (then in
 * ``pieces``), waiting up to ``wait_ns`` while those missing are all being fetched. */
static int have_or_wait(Memory *self, uint64_t first, uint64_t count, held **pieces,
                        int disk_too, int64_t *waited_ns) {
    struct timespec deadline = {0, 0}, began = {0, 0};
    for (;;) {
        if (deadline.tv_sec != 0 || deadline.tv_nsec != 0) {
            /* How long this READ has waited so far: Python's deadline counts it. */
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            *waited_ns = (int64_t)(now.tv_sec - began.tv_sec) * 1000000000L +
                         (now.tv_nsec - began.tv_nsec);
        }
        if (self->log_len + self->log_reserved >= self->log_cap) {
            return 0; /* Python drains it first */
        }
        int whole = 1, waitable = 1;
        uint64_t missing = 0; /* the first sector not in the table: its stripe is waited on */
        for (uint64_t i = 0; i < count; i++) {
            pieces[i] = self->slots[first + i];
            if (pieces[i] != NULL && pieces[i]->path != NULL && !disk_too) {
                return 0; /* a small read of an entry: Python's read-around serves those */
            }
            if (pieces[i] == NULL) {
                if (whole) missing = first + i;
                whole = 0;
                waitable = waitable && self->pending[first + i];
            }
        }
        if (whole) {
            return 1;
        }
        if (!waitable || self->wait_ns == 0) {
            return 0;
        }
        if (deadline.tv_sec == 0 && deadline.tv_nsec == 0) {
            clock_gettime(CLOCK_MONOTONIC, &deadline);
            began = deadline;
            deadline.tv_nsec += self->wait_ns % 1000000000L;
            deadline.tv_sec += self->wait_ns / 1000000000L + deadline.tv_nsec / 1000000000L;
            deadline.tv_nsec %= 1000000000L;
        }
        /* Woken when that sector arrives (then the next one missing is waited for), when a
         * fetch fails, or at the deadline. */
        if (pthread_cond_timedwait(&self->arrived[missing % WAIT_STRIPES], &self->mu,
                                   &deadline) == ETIMEDOUT) {
            *waited_ns = self->wait_ns;
            return 0; /* Python waits on, with its own deadline less this wait */
        }
    }
}

/* Answer READs from the table until a request must go to Python; the interpreter's lock is
 * not held. Returns a status; *got: the request's length for ST_REQUEST; *err: the errno;
 * *waited_ns: how long that request waited here for a fetch. */
static int serve_loop(Memory *self, int fd, unsigned char *buf, size_t size, ssize_t *got,
                      int *err, int64_t *waited_ns) {
    held *pieces[MAX_PIECES];
    struct iovec iov[MAX_PIECES + 1];
    for (;;) {
        *waited_ns = 0;
        ssize_t n = read(fd, buf, size);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT) {
                continue; /* interrupted, or a request withdrawn before we read it */
            }
            if (errno == ENODEV) {
                return ST_ENDED; /* unmounted */
            }
            *err = errno;
            return -1;
        }
        if (n == 0) {
            return ST_ENDED; /* /dev/fuse never reads as empty; a socket at its end does */
        }
        __atomic_add_fetch(&self->in_flight, 1, __ATOMIC_SEQ_CST);
        *got = n;
        uint32_t opcode;
        uint64_t unique, offset;
        uint32_t length;
        if (n < IN_HEADER + READ_IN) {
            return ST_REQUEST;
        }
        memcpy(&opcode, buf + 4, 4);
        if (opcode != FUSE_READ) {
            return ST_REQUEST;
        }
        memcpy(&unique, buf + 8, 8);
        memcpy(&offset, buf + IN_HEADER + 8, 8);
        memcpy(&length, buf + IN_HEADER + 16, 4);
        if (length == 0 || offset >= self->image_size) {
            return ST_REQUEST; /* past the end: Python answers those */
        }
        uint64_t end = self->image_size - offset < length ? self->image_size : offset + length;
        uint64_t first = offset / self->sector_size, last = (end - 1) / self->sector_size;
        uint64_t count = last - first + 1;
        if (count > MAX_PIECES) {
            return ST_REQUEST;
        }
        pthread_mutex_lock(&self->mu);
        if (!have_or_wait(self, first, count, pieces, end - offset > self->disk_min_read,
                          waited_ns)) {
            pthread_mutex_unlock(&self->mu);
            return ST_REQUEST;
        }
        int disk = 0;
        for (uint64_t i = 0; i < count; i++) {
            pieces[i]->pins++;
            disk += pieces[i]->path != NULL;
        }
        self->log_reserved++; /* this READ's entry in the log, taken while there is room */
        pthread_mutex_unlock(&self->mu);

        /* Sectors in cache entries: their blocks read and checked before anything is sent
         * (a page-aligned stretch of this thread's scratch each). */
        unsigned char *scratch = NULL;
        if (disk) {
            size_t need = 0;
            for (uint64_t i = 0; i < count; i++) {
                if (pieces[i]->path != NULL) {
                    need += (size_t)((end - offset + 2 * (uint64_t)pieces[i]->block + 8191) /
                                     4096 * 4096);
                }
            }
            scratch = scratch_of(need);
        }
        int ok = !disk || scratch != NULL;
        held *bad = NULL;
        size_t used = 0;
        uint32_t out_len = (uint32_t)(OUT_HEADER + (end - offset));
        int32_t error = 0;
        unsigned char header[OUT_HEADER];
        memcpy(header, &out_len, 4);
        memcpy(header + 4, &error, 4);
        memcpy(header + 8, &unique, 8);
        iov[0].iov_base = header;
        iov[0].iov_len = OUT_HEADER;
        for (uint64_t i = 0; ok && i < count; i++) {
            uint64_t start = (first + i) * self->sector_size;
            uint64_t span = span_of(self, first + i);
            uint64_t lo = (offset > start ? offset : start) - start;
            uint64_t stop = start + span;
            uint64_t hi = (end < stop ? end : stop) - start;
            if (pieces[i]->path == NULL) {
                iov[i + 1].iov_base = (unsigned char *)pieces[i]->view.buf + lo;
            } else {
                ssize_t at = read_checked(pieces[i], span, lo, hi, scratch + used);
                if (at < 0) {
                    ok = 0;
                    bad = pieces[i];
                    break;
                }
                iov[i + 1].iov_base = scratch + used + at;
                uint64_t b = pieces[i]->block;
                used += (size_t)(((hi + b - 1) / b * b - lo / b * b + 4095) / 4096 * 4096);
            }
            iov[i + 1].iov_len = hi - lo;
        }

        pthread_mutex_lock(&self->mu);
        self->log_reserved--;
        if (disk) {
            self->disk_reads++;
        }
        int drain = 0;
        if (ok) {
            /* Logged before the answer goes, even if the kernel no longer wants it (ENOENT
             * below): it was asked for. */
            self->log[2 * self->log_len] = offset;
            self->log[2 * self->log_len + 1] = end - offset;
            self->log_len++;
            self->served++;
            self->served_bytes += end - offset;
            if (unique & UNIQUE_RESEND) {
                self->resent++;
            }
            drain = self->log_len >= self->drain_every;
        } else {
            self->disk_failures++;
            /* Python reads it again its own way (and deals with a damaged entry); this
             * entry is not read here again until Python gives it anew. */
            for (uint64_t i = 0; bad != NULL && i < count; i++) {
                if (self->slots[first + i] == bad) {
                    self->slots[first + i] = NULL;
                    bad->dead = 1;
                }
            }
            unpin(self, pieces, count);
        }
        pthread_mutex_unlock(&self->mu);
        if (!ok) {
            return ST_REQUEST;
        }

        ssize_t wrote = writev(fd, iov, (int)count + 1);
        int werr = wrote < 0 ? errno : 0;

        pthread_mutex_lock(&self->mu);
        unpin(self, pieces, count);
        pthread_mutex_unlock(&self->mu);
        __atomic_sub_fetch(&self->in_flight, 1, __ATOMIC_SEQ_CST);

        if (werr == ENODEV) {
            return ST_ENDED;
        }
        if (werr != 0 && werr != ENOENT) { /* ENOENT: withdrawn (interrupted, reader died) */
            *err = werr;
            return ST_REPLY_FAILED;
        }
        if (drain) {
            return ST_DRAIN;
        }
    }
}

PyDoc_STRVAR(serve_doc,
             "serve(fd, buffer) -> (status, n, waited): read requests from ``fd`` into "
             "``buffer`` and answer the READs this table can, until one of: 0, a request for "
             "the caller (its n bytes in ``buffer``; call handed() once it counts it; "
             "``waited``: the seconds it waited here for a fetch, which the caller's "
             "deadline counts); 1, the log wants a drain(); 2, the connection ended "
             "(unmounted); 3, an answer could not be written (n: its errno). Raises OSError "
             "when reading ``fd`` fails.");

static PyObject *Memory_serve(Memory *self, PyObject *args) {
    int fd;
    Py_buffer buf;
    if (check_ready(self) < 0 || !PyArg_ParseTuple(args, "iw*", &fd, &buf)) {
        return NULL;
    }
    ssize_t got = 0;
    int64_t waited_ns = 0;
    int err = 0, status;
    Py_BEGIN_ALLOW_THREADS
    status = serve_loop(self, fd, buf.buf, (size_t)buf.len, &got, &err, &waited_ns);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    bury(self);
    if (status < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (status == ST_REPLY_FAILED) {
        got = err;
    } else if (status != ST_REQUEST) {
        got = 0;
    }
    if (status != ST_REQUEST) {
        waited_ns = 0;
    }
    return Py_BuildValue("(ind)", status, got, (double)waited_ns / 1e9);
}

static PyObject *Memory_get_in_flight(Memory *self, void *closure) {
    return PyLong_FromLongLong(__atomic_load_n(&self->in_flight, __ATOMIC_SEQ_CST));
}

static PyObject *counter(Memory *self, uint64_t *field) {
    pthread_mutex_lock(&self->mu);
    uint64_t value = *field;
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *Memory_get_served(Memory *self, void *c) {
    return check_ready(self) < 0 ? NULL : counter(self, &self->served);
}

static PyObject *Memory_get_served_bytes(Memory *self, void *c) {
    return check_ready(self) < 0 ? NULL : counter(self, &self->served_bytes);
}

static PyObject *Memory_get_resent(Memory *self, void *c) {
    return check_ready(self) < 0 ? NULL : counter(self, &self->resent);
}

static PyObject *Memory_get_disk_reads(Memory *self, void *c) {
    return check_ready(self) < 0 ? NULL : counter(self, &self->disk_reads);
}

static PyObject *Memory_get_disk_failures(Memory *self, void *c) {
    return check_ready(self) < 0 ? NULL : counter(self, &self->disk_failures);
}

static PyObject *Memory_get_sectors(Memory *self, void *c) {
    if (check_ready(self) < 0) {
        return NULL;
    }
    uint64_t in = 0;
    pthread_mutex_lock(&self->mu);
    for (uint64_t n = 0; n < self->count; n++) {
        in += self->slots[n] != NULL;
    }
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromUnsignedLongLong(in);
}

static PyGetSetDef Memory_getset[] = {
    {"in_flight", (getter)Memory_get_in_flight, NULL, "requests read and not yet answered",
     NULL},
    {"served", (getter)Memory_get_served, NULL, "READs answered here", NULL},
    {"served_bytes", (getter)Memory_get_served_bytes, NULL, "bytes those READs answered",
     NULL},
    {"resent", (getter)Memory_get_resent, NULL, "resent READs (FUSE_NOTIFY_RESEND) answered here",
     NULL},
    {"sectors", (getter)Memory_get_sectors, NULL, "sectors in the table", NULL},
    {"disk_reads", (getter)Memory_get_disk_reads, NULL,
     "READs that read sectors from cache entries here", NULL},
    {"disk_failures", (getter)Memory_get_disk_failures, NULL,
     "... of which a block did not read or check: handed to Python", NULL},
    {NULL},
};

static PyMethodDef Memory_methods[] = {
    {"put", (PyCFunction)Memory_put, METH_VARARGS, put_doc},
    {"drop", (PyCFunction)Memory_drop, METH_VARARGS, drop_doc},
    {"cached", (PyCFunction)Memory_cached, METH_VARARGS, cached_doc},
    {"uncache", (PyCFunction)Memory_uncache, METH_VARARGS, uncache_doc},
    {"pending", (PyCFunction)Memory_pending, METH_VARARGS, pending_doc},
    {"settled", (PyCFunction)Memory_settled, METH_VARARGS, settled_doc},
    {"clear", (PyCFunction)Memory_clear, METH_NOARGS, clear_doc},
    {"drain", (PyCFunction)Memory_drain, METH_NOARGS, drain_doc},
    {"handed", (PyCFunction)Memory_handed, METH_NOARGS, handed_doc},
    {"serve", (PyCFunction)Memory_serve, METH_VARARGS, serve_doc},
    {NULL},
};

static PyTypeObject MemoryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "snapshotter.mount._fastreads.Memory",
    .tp_doc = PyDoc_STR("Memory(sector_size, image_size, drain_every=4, log_capacity=4096, "
                        "wait_seconds=0.25, disk_min_read=0): the sectors a mount's reader "
                        "keeps in memory, and cache entries it checked, for FUSE READs "
                        "answered without the interpreter (of entries, only READs longer "
                        "than disk_min_read)."),
    .tp_basicsize = sizeof(Memory),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Memory_init,
    .tp_dealloc = (destructor)Memory_dealloc,
    .tp_methods = Memory_methods,
    .tp_getset = Memory_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "snapshotter.mount._fastreads",
    "FUSE READs answered from sector memory without the interpreter (see the source).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastreads(void) {
    if (PyType_Ready(&MemoryType) < 0) {
        return NULL;
    }
    static int keyed = 0;
    if (!keyed) {
        if (pthread_key_create(&scratch_key, scratch_free) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_key_create failed");
            return NULL;
        }
        keyed = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&MemoryType);
    if (PyModule_AddObject(m, "Memory", (PyObject *)&MemoryType) < 0) {
        Py_DECREF(&MemoryType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "REQUEST", ST_REQUEST);
    PyModule_AddIntConstant(m, "DRAIN", ST_DRAIN);
    PyModule_AddIntConstant(m, "ENDED", ST_ENDED);
    PyModule_AddIntConstant(m, "REPLY_FAILED", ST_REPLY_FAILED);
    return m;
}
