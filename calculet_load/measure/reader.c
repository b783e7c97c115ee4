/* calculet_load.measure._reader: a response's reads in a native thread of their own.
 *
 * The thread I/O engine (measure/thread_engine.py) hands a plain (not TLS) socket to a Reader
 * while a response comes in (`watch`). The Reader's thread waits on its own epoll set,
 * without the interpreter lock, and reads each ready socket at once (or, while reads come
 * densely, every socket ready at most coalesce_ns after the last pass: thread_main): one
 * recvmsg that asks the kernel for the bytes' receive time (SCM_TIMESTAMPNS,
 * CLOCK_REALTIME), then CLOCK_MONOTONIC and CLOCK_REALTIME read as a pair right after it
 * returned (clock_pair). It keeps each read
 * (bytes and the three times) in order, and tells the engine's loop (one write to an
 * eventfd the loop watches) when a response has reads the engine must see now:
 *
 *   - eager (the response's head is not read yet, or a cancel is asked for): each read;
 *   - lazy (an event stream's chunked body): a read that ends in CRLF CRLF (the last
 *     chunk, its trailers: a response's end), the end of the stream or a failure, or
 *     more than LAZY_MAX_BYTES waiting;
 *   - and whenever the engine asks (`take`: its timers, at each read limit).
 *
 * So a token event's read costs a system call or two and no Python, and its stamp does
 * not wait for the interpreter lock: the engine parses the reads later, in order, with
 * the stamps they were taken with (the same parser, the same figures).
 *
 * A socket that asked for the transmit stamps of what it sends (measure/txstamps.py)
 * reports an error to epoll while one waits in its error queue: such a wake-up reads the
 * queue (read_errqueue) and keeps the stamps for the engine (`sent`), or the thread would
 * wake again and again, reading nothing.
 *
 * No Python object is touched in the thread; a mutex guards the table of sockets, and
 * `unwatch` returns only when the thread no longer reads that socket.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SO_TIMESTAMPNS
#define SO_TIMESTAMPNS 35
#endif
#ifndef SCM_TIMESTAMPNS
#define SCM_TIMESTAMPNS SO_TIMESTAMPNS
#endif
#ifndef SO_TIMESTAMPING
#define SO_TIMESTAMPING 37
#endif
#ifndef SCM_TIMESTAMPING
#define SCM_TIMESTAMPING SO_TIMESTAMPING
#endif
#ifndef IP_RECVERR
#define IP_RECVERR 11
#endif
#ifndef IPV6_RECVERR
#define IPV6_RECVERR 25
#endif
#ifndef SO_EE_ORIGIN_TIMESTAMPING
#define SO_EE_ORIGIN_TIMESTAMPING 4
#endif
#define ERRQUEUE_CMSG 256 /* SCM_TIMESTAMPNS, SCM_TIMESTAMPING, IP(V6)_RECVERR */
#define MAX_SENT 8        /* transmit stamps kept per socket until the engine takes them */

#define READ_BYTES 65536
#define LAZY_MAX_BYTES (256 * 1024)
#define MAX_EVENTS 64
/* coalescing (thread_main): the reads a pass must expect, the moving average's weight */
#define DENSE_READS 3.0
#define RATE_WEIGHT 0.125

typedef struct Read {
    struct Read *next;
    int64_t mono, wall, kernel; /* kernel: the receive time (CLOCK_REALTIME), or -1 */
    int err;                    /* errno of a failed read (no bytes), else 0 */
    size_t len;                 /* 0 with err 0: the peer closed */
    char data[];
} Read;

typedef struct {
    uint32_t key;                /* the byte it stamps, counted since stamps were asked for */
    int64_t stamp, mono, wall;   /* CLOCK_REALTIME; the queue read at mono, wall (a pair) */
} Sent;

typedef struct {
    int watched; /* in the epoll set */
    int lazy;
    int queued;  /* in the ready list */
    int ended;   /* end of stream or a failure seen: no more reads */
    size_t waiting; /* bytes in reads not taken */
    Read *head, *tail;
    Sent sent[MAX_SENT]; /* transmit stamps read from the error queue, oldest first */
    int nsent;
} Slot;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_t thread;
    int running;
    int ep;      /* the thread's epoll set */
    int wake;    /* eventfd: the thread's own wake-up (close) */
    int notify;  /* eventfd the engine's loop watches */
    Slot *slots; /* by fd */
    int nslots;
    int *ready;  /* fds with reads the engine must see */
    int nready, cap_ready;
    int stop;
    pid_t pid;     /* the process that started the thread (a fork's child has none) */
    int64_t coalesce_ns; /* the shortest time between two wake-ups while reads come densely */
    char name[16]; /* the thread's name (the OS's, at most 15 bytes) */
} Reader;

static int64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A read's return time and the wall clock read with it, as a pair on one instant: the
 * kernel's stamp (CLOCK_REALTIME) is moved onto the monotonic clock by their difference,
 * so a thread preempted between the two reads would move it by the preemption. Read
 * again (at most PAIR_TRIES times) until a monotonic read after the wall one is within
 * PAIR_NS of the one before it. */
#define PAIR_NS 20000
#define PAIR_TRIES 4
static void clock_pair(int64_t *mono, int64_t *wall) {
    for (int i = 0; i < PAIR_TRIES; i++) {
        *mono = now_ns(CLOCK_MONOTONIC);
        *wall = now_ns(CLOCK_REALTIME);
        if (now_ns(CLOCK_MONOTONIC) - *mono <= PAIR_NS)
            return;
    }
}

static void free_reads(Slot *s) {
    Read *r = s->head;
    while (r) {
        Read *next = r->next;
        free(r);
        r = next;
    }
    s->head = s->tail = NULL;
    s->waiting = 0;
}

/* with the lock held: fd's slot goes on the ready list; 1 when the list was empty */
static int mark_ready(Reader *self, int fd) {
    Slot *s = &self->slots[fd];
    if (s->queued)
        return 0;
    if (self->nready == self->cap_ready) {
        int cap = self->cap_ready ? self->cap_ready * 2 : 64;
        int *grown = realloc(self->ready, sizeof(int) * cap);
        if (!grown)
            return 0; /* the engine's timer takes the reads (`take`) */
        self->ready = grown;
        self->cap_ready = cap;
    }
    s->queued = 1;
    self->ready[self->nready++] = fd;
    return self->nready == 1;
}

/* with the lock held: one read of fd, kept in its slot; 1 when the engine must be told */
static int read_one(Reader *self, int fd, char *buf, char *cbuf, size_t clen) {
    Slot *s = &self->slots[fd];
    if (!s->watched || s->ended)
        return 0;
    struct iovec iov = {buf, READ_BYTES};
    struct msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf;
    msg.msg_controllen = clen;
    ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT);
    int err = n < 0 ? errno : 0;
    if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK || err == EINTR))
        return 0;
    int64_t mono, wall;
    clock_pair(&mono, &wall);
    int64_t kernel = -1;
    if (n > 0) {
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS &&
                c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
                struct timespec ts;
                memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                kernel = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
                break;
            }
        }
    }
    size_t len = n > 0 ? (size_t)n : 0;
    Read *r = malloc(sizeof(Read) + len);
    if (!r) {
        err = ENOMEM;
        len = 0;
        r = malloc(sizeof(Read));
        if (!r)
            return 0;
    }
    r->next = NULL;
    r->mono = mono;
    r->wall = wall;
    r->kernel = kernel;
    r->err = err;
    r->len = len;
    if (len)
        memcpy(r->data, buf, len);
    if (s->tail)
        s->tail->next = r;
    else
        s->head = r;
    s->tail = r;
    s->waiting += len;
    int now = !s->lazy || len == 0;
    if (len == 0) {
        /* the end of the stream, or a failure: no more reads (a closed socket stays
         * readable: it would wake the thread at every wait) */
        s->ended = 1;
        epoll_ctl(self->ep, EPOLL_CTL_DEL, fd, NULL);
        s->watched = 0;
    } else if (len >= 4 && memcmp(buf + len - 4, "\r\n\r\n", 4) == 0) {
        now = 1; /* the last chunk (and its trailers): the response's end */
    } else if (s->waiting > LAZY_MAX_BYTES) {
        now = 1;
    }
    return now ? mark_ready(self, fd) : 0;
}

/* with the lock held: the transmit stamps in fd's error queue, kept in its slot (the
 * newest MAX_SENT); what else the queue holds is read and dropped */
static void read_errqueue(Reader *self, int fd) {
    Slot *s = &self->slots[fd];
    char cbuf[ERRQUEUE_CMSG];
    for (int i = 0; i < 64; i++) {
        struct msghdr msg;
        memset(&msg, 0, sizeof(msg));
        msg.msg_control = cbuf;
        msg.msg_controllen = sizeof(cbuf);
        if (recvmsg(fd, &msg, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
            return; /* empty (EAGAIN), or the socket failed: its read says how */
        int64_t mono, wall, stamp = -1;
        clock_pair(&mono, &wall);
        int is_send = 0;
        uint32_t key = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level == SOL_SOCKET &&
                (c->cmsg_type == SCM_TIMESTAMPNS || c->cmsg_type == SCM_TIMESTAMPING) &&
                c->cmsg_len >= CMSG_LEN(sizeof(struct timespec)) && stamp < 0) {
                struct timespec ts; /* SCM_TIMESTAMPING: its software stamp comes first */
                memcpy(&ts, CMSG_DATA(c), sizeof(ts));
                stamp = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
            } else if (((c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR) ||
                        (c->cmsg_level == SOL_IPV6 && c->cmsg_type == IPV6_RECVERR)) &&
                       c->cmsg_len >= CMSG_LEN(sizeof(struct sock_extended_err))) {
                struct sock_extended_err ee;
                memcpy(&ee, CMSG_DATA(c), sizeof(ee));
                is_send = ee.ee_errno == ENOMSG && ee.ee_origin == SO_EE_ORIGIN_TIMESTAMPING &&
                          ee.ee_info == SCM_TSTAMP_SND;
                key = ee.ee_data;
            }
        }
        if (!is_send || stamp <= 0)
            continue;
        if (s->nsent == MAX_SENT) {
            memmove(s->sent, s->sent + 1, sizeof(Sent) * (MAX_SENT - 1));
            s->nsent--;
        }
        s->sent[s->nsent++] = (Sent){key, stamp, mono, wall};
    }
}

static void *thread_main(void *arg) {
    Reader *self = (Reader *)arg;
    struct epoll_event events[MAX_EVENTS];
    char *buf = malloc(READ_BYTES);
    size_t clen = CMSG_SPACE(sizeof(struct timespec)) * 2;
    char *cbuf = malloc(clen);
    if (!buf || !cbuf) {
        free(buf);
        free(cbuf);
        return NULL;
    }
    /* Coalescing: each wake-up costs this thread a context switch, and a read need not
     * come early, only before the same socket's next bytes: the kernel stamps their
     * arrival. So while reads come densely, the thread sleeps out the rest of coalesce_ns
     * after each wake-up and then reads every socket that became ready meanwhile in one
     * pass. Dense: the sockets ready per wake-up over the time between wake-ups (each a
     * moving average) would fill a coalesce_ns pass with DENSE_READS or more. Sparser, a
     * sleep would often find one socket or none ready (measured: more CPU a read than
     * reading each as it comes), and each read is made at once. The cost: two events of
     * one stream that arrive within a pass's window share its read and stamp, so the
     * window is opt-in (coalesce_ns 0 by default: measure.thread_loop, READ_COALESCE_ENV). */
    int64_t woke = 0;
    double per_wake = 1.0, gap = 1e9; /* sockets ready, ns between wake-ups */
    for (;;) {
        if (self->coalesce_ns > 0 && per_wake * (double)self->coalesce_ns >= DENSE_READS * gap) {
            int64_t until = woke + self->coalesce_ns;
            struct timespec ts = {until / 1000000000LL, until % 1000000000LL};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
        }
        int n = epoll_wait(self->ep, events, MAX_EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        int64_t now = now_ns(CLOCK_MONOTONIC);
        if (woke > 0) {
            per_wake += RATE_WEIGHT * ((double)n - per_wake);
            gap += RATE_WEIGHT * ((double)(now - woke) - gap);
        }
        woke = now;
        int tell = 0, stop = 0;
        /* the lock for one read at a time: the engine's calls wait for it (without the
         * interpreter lock: lock_released) no longer than a read. With no timeout, n >= 1:
         * `stop` is read at each event, and stop_thread wakes this wait after setting it */
        for (int i = 0; i < n && !stop; i++) {
            int fd = events[i].data.fd;
            pthread_mutex_lock(&self->lock);
            stop = self->stop;
            if (!stop && fd != self->wake && fd >= 0 && fd < self->nslots) {
                if ((events[i].events & EPOLLERR) && self->slots[fd].watched)
                    read_errqueue(self, fd);
                tell |= read_one(self, fd, buf, cbuf, clen);
            }
            pthread_mutex_unlock(&self->lock);
        }
        if (stop)
            break;
        if (tell) {
            uint64_t one = 1;
            ssize_t w = write(self->notify, &one, sizeof(one));
            (void)w;
        }
    }
    free(buf);
    free(cbuf);
    return NULL;
}

/* The engine's calls take the lock without holding the interpreter's while they wait:
 * the reader's thread can be descheduled with the lock held (a busy machine), and a wait
 * that holds the interpreter lock holds every greenlet with it. */
static void lock_released(Reader *self) {
    if (pthread_mutex_trylock(&self->lock) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    Py_END_ALLOW_THREADS
}

static int grow(Reader *self, int fd) {
    if (fd < self->nslots)
        return 0;
    int n = self->nslots ? self->nslots : 256;
    while (n <= fd)
        n *= 2;
    Slot *grown = realloc(self->slots, sizeof(Slot) * n);
    if (!grown)
        return -1;
    memset(grown + self->nslots, 0, sizeof(Slot) * (n - self->nslots));
    self->slots = grown;
    self->nslots = n;
    return 0;
}

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Reader *self = (Reader *)type->tp_alloc(type, 0);
    if (self) {
        self->ep = self->wake = self->notify = -1;
        pthread_mutex_init(&self->lock, NULL);
    }
    return (PyObject *)self;
}

static int Reader_init(Reader *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"name", "coalesce_ns", NULL};
    const char *name = "cl-reader";
    long long coalesce = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|sL", names, &name, &coalesce))
        return -1;
    if (coalesce < 0 || coalesce > 1000000000LL) {
        PyErr_SetString(PyExc_ValueError, "coalesce_ns: 0 to 1e9");
        return -1;
    }
    self->coalesce_ns = coalesce;
    strncpy(self->name, name, sizeof(self->name) - 1);
    if (self->ep >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "a Reader is initialised once");
        return -1;
    }
    self->ep = epoll_create1(EPOLL_CLOEXEC);
    self->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    self->notify = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (self->ep < 0 || self->wake < 0 || self->notify < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = self->wake};
    epoll_ctl(self->ep, EPOLL_CTL_ADD, self->wake, &ev);
    if (pthread_create(&self->thread, NULL, thread_main, self) != 0) {
        PyErr_SetString(PyExc_OSError, "cannot start the reader's thread");
        return -1;
    }
    self->running = 1;
    self->pid = getpid();
    /* `top -H`, the benchmark's CPU by thread: named before `Reader()` returns */
    pthread_setname_np(self->thread, self->name);
    return 0;
}

static void stop_thread(Reader *self) {
    if (!self->running)
        return;
    if (self->pid != getpid()) {
        /* a fork's copy: the thread (and whoever held the lock) stayed in the parent */
        self->running = 0;
        pthread_mutex_init(&self->lock, NULL);
        return;
    }
    lock_released(self);
    self->stop = 1;
    pthread_mutex_unlock(&self->lock);
    uint64_t one = 1;
    ssize_t w = write(self->wake, &one, sizeof(one));
    (void)w;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->running = 0;
}

static void Reader_dealloc(Reader *self) {
    stop_thread(self);
    for (int fd = 0; fd < self->nslots; fd++)
        free_reads(&self->slots[fd]);
    free(self->slots);
    free(self->ready);
    if (self->ep >= 0)
        close(self->ep);
    if (self->wake >= 0)
        close(self->wake);
    if (self->notify >= 0)
        close(self->notify);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Reader_watch(Reader *self, PyObject *args) {
    int fd, lazy;
    if (!PyArg_ParseTuple(args, "ip", &fd, &lazy))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "a negative file descriptor");
        return NULL;
    }
    lock_released(self);
    if (grow(self, fd) < 0) {
        pthread_mutex_unlock(&self->lock);
        return PyErr_NoMemory();
    }
    Slot *s = &self->slots[fd];
    if (s->watched) {
        pthread_mutex_unlock(&self->lock);
        PyErr_Format(PyExc_ValueError, "fd %d is watched already", fd);
        return NULL;
    }
    free_reads(s);
    s->lazy = lazy;
    s->ended = 0;
    s->nsent = 0;
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd};
    if (epoll_ctl(self->ep, EPOLL_CTL_ADD, fd, &ev) < 0) {
        int err = errno;
        pthread_mutex_unlock(&self->lock);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    s->watched = 1;
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Reader_lazy(Reader *self, PyObject *args) {
    int fd, lazy;
    if (!PyArg_ParseTuple(args, "ip", &fd, &lazy))
        return NULL;
    lock_released(self);
    if (fd >= 0 && fd < self->nslots)
        self->slots[fd].lazy = lazy;
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Reader_unwatch(Reader *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    lock_released(self);
    if (fd >= 0 && fd < self->nslots) {
        Slot *s = &self->slots[fd];
        if (s->watched)
            epoll_ctl(self->ep, EPOLL_CTL_DEL, fd, NULL);
        s->watched = 0;
        s->ended = 0;
        s->nsent = 0;
        free_reads(s);
        /* a queued entry stays in the ready list; `ready` skips what has no reads */
    }
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

/* take: fd's reads, oldest first, as a list of (bytes, mono, wall, kernel or -1, errno) */
static PyObject *Reader_take(Reader *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    lock_released(self);
    Read *r = NULL;
    if (fd >= 0 && fd < self->nslots) {
        Slot *s = &self->slots[fd];
        r = s->head;
        s->head = s->tail = NULL;
        s->waiting = 0;
    }
    pthread_mutex_unlock(&self->lock);
    PyObject *out = PyList_New(0);
    while (r) {
        Read *next = r->next;
        if (out) {
            PyObject *item = Py_BuildValue("(y#LLLi)", r->data, (Py_ssize_t)r->len,
                                           (long long)r->mono, (long long)r->wall,
                                           (long long)r->kernel, r->err);
            if (!item || PyList_Append(out, item) < 0)
                Py_CLEAR(out);
            Py_XDECREF(item);
        }
        free(r);
        r = next;
    }
    return out;
}

/* sent: fd's transmit stamps read from its error queue, oldest first, as a list of
 * (key, stamp, mono, wall) (measure/txstamps.py takes them) */
static PyObject *Reader_sent(Reader *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    Sent got[MAX_SENT];
    int n = 0;
    lock_released(self);
    if (fd >= 0 && fd < self->nslots) {
        Slot *s = &self->slots[fd];
        n = s->nsent;
        memcpy(got, s->sent, sizeof(Sent) * n);
        s->nsent = 0;
    }
    pthread_mutex_unlock(&self->lock);
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < n; i++) {
        PyObject *item = Py_BuildValue("(kLLL)", (unsigned long)got[i].key,
                                       (long long)got[i].stamp, (long long)got[i].mono,
                                       (long long)got[i].wall);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

/* ready: the fds with reads the engine must see now (each once), and resets the eventfd */
static PyObject *Reader_ready(Reader *self, PyObject *noargs) {
    uint64_t count;
    ssize_t got = read(self->notify, &count, sizeof(count));
    (void)got;
    lock_released(self);
    PyObject *out = PyList_New(0);
    for (int i = 0; i < self->nready; i++) {
        int fd = self->ready[i];
        Slot *s = &self->slots[fd];
        s->queued = 0;
        if (out && s->head) {
            PyObject *n = PyLong_FromLong(fd);
            if (!n || PyList_Append(out, n) < 0)
                Py_CLEAR(out);
            Py_XDECREF(n);
        }
    }
    self->nready = 0;
    pthread_mutex_unlock(&self->lock);
    return out;
}

static PyObject *Reader_fileno(Reader *self, PyObject *noargs) {
    return PyLong_FromLong(self->notify);
}

static PyObject *Reader_close(Reader *self, PyObject *noargs) {
    stop_thread(self);
    Py_RETURN_NONE;
}

static PyMethodDef Reader_methods[] = {
    {"watch", (PyCFunction)Reader_watch, METH_VARARGS,
     "watch(fd, lazy): read fd in the thread from now (lazy: tell the engine at a "
     "response's end only)"},
    {"lazy", (PyCFunction)Reader_lazy, METH_VARARGS, "lazy(fd, lazy): change fd's mode"},
    {"unwatch", (PyCFunction)Reader_unwatch, METH_VARARGS,
     "unwatch(fd): stop reading fd; its reads not taken are dropped"},
    {"take", (PyCFunction)Reader_take, METH_VARARGS,
     "take(fd): fd's reads, oldest first: [(bytes, mono_ns, wall_ns, kernel_wall_ns or -1, "
     "errno)]"},
    {"sent", (PyCFunction)Reader_sent, METH_VARARGS,
     "sent(fd): fd's transmit stamps read from its error queue, oldest first: "
     "[(key, stamp_wall_ns, mono_ns, wall_ns)]"},
    {"ready", (PyCFunction)Reader_ready, METH_NOARGS,
     "ready(): the fds with reads to see now (call when fileno() is readable)"},
    {"fileno", (PyCFunction)Reader_fileno, METH_NOARGS,
     "the eventfd that is readable when ready() has fds"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "stop the thread"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "calculet_load.measure._reader.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A response's reads in a native thread (see the module's source).",
    .tp_new = Reader_new,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_reader",
    "A response's reads in a native thread of their own (measure/reader.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__reader(void) {
    if (PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(&ReaderType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "LAZY_MAX_BYTES", LAZY_MAX_BYTES);
    return m;
}
