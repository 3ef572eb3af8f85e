/* The key builder's inner loops in C: a lookup's chain hashes, tail hashes and object refs.
 *
 * connector/core/native.py loads this module where it was built and falls back to the pure-Python
 * reference (connector/core/hashing.py, connector/core/prefix.py) where it was not; a property test
 * (tests/unit/test_native_keys.py) holds the two equal on random prompts. The bytes hashed are the
 * reference's exactly: BLAKE2b-128 (RFC 7693, no key) over length-prefixed parts, each part's length a
 * little-endian uint32.
 *
 *   block_chain(packed, block_size, root) -> [digest of each full block]
 *   tail_digests(packed, tail_start, ends, parent) -> [digest of the tail ending at each end]
 *   build_refs(ref_type, prefix, group, kind, block_size, ends, hashes, refs, by_key) -> [ref]
 *
 * Everything here runs with the GIL held (it creates Python objects); each call is short.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 16

typedef struct {
    uint64_t h[8];
    uint64_t t[2];
    uint8_t b[128];
    size_t c;
} blake2b_state;

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
#endif
}

#define G(a, b, c, d, x, y)               \
    do {                                  \
        v[a] = v[a] + v[b] + (x);         \
        v[d] = rotr64(v[d] ^ v[a], 32);   \
        v[c] = v[c] + v[d];               \
        v[b] = rotr64(v[b] ^ v[c], 24);   \
        v[a] = v[a] + v[b] + (y);         \
        v[d] = rotr64(v[d] ^ v[a], 16);   \
        v[c] = v[c] + v[d];               \
        v[b] = rotr64(v[b] ^ v[c], 63);   \
    } while (0)

static void compress(blake2b_state *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    for (int i = 0; i < 16; i++) m[i] = load64(s->b + 8 * i);
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = SIGMA[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void b2_init(blake2b_state *s) {
    memcpy(s->h, IV, sizeof IV);
    s->h[0] ^= 0x01010000ULL ^ DIGEST; /* no key, fan-out 1, depth 1, 16-byte digest */
    s->t[0] = s->t[1] = 0;
    s->c = 0;
}

static void b2_update(blake2b_state *s, const uint8_t *in, size_t n) {
    while (n > 0) {
        if (s->c == 128) { /* a full buffer is compressed only once more input follows (the last is final) */
            s->t[0] += 128;
            if (s->t[0] < 128) s->t[1]++;
            compress(s, 0);
            s->c = 0;
        }
        size_t take = 128 - s->c < n ? 128 - s->c : n;
        memcpy(s->b + s->c, in, take);
        s->c += take;
        in += take;
        n -= take;
    }
}

static void b2_part(blake2b_state *s, const uint8_t *in, size_t n) {
    /* One length-prefixed part, as hashing._digest frames it. */
    uint8_t size[4] = {(uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24)};
    b2_update(s, size, 4);
    b2_update(s, in, n);
}

static void b2_final(blake2b_state *s, uint8_t out[DIGEST]) {
    s->t[0] += s->c;
    if (s->t[0] < s->c) s->t[1]++;
    memset(s->b + s->c, 0, 128 - s->c);
    compress(s, 1);
    for (int i = 0; i < DIGEST; i++) out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}

static PyObject *block_chain(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer packed;
    Py_ssize_t block_size;
    const char *root;
    Py_ssize_t root_len;
    if (!PyArg_ParseTuple(args, "y*ny#", &packed, &block_size, &root, &root_len)) return NULL;
    PyObject *out = NULL;
    if (block_size <= 0 || block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        goto done;
    }
    Py_ssize_t width = 4 * block_size, count = packed.len / width;
    out = PyList_New(count);
    if (out == NULL) goto done;
    uint8_t parent[DIGEST];
    const uint8_t *parent_at = (const uint8_t *)root;
    size_t parent_len = (size_t)root_len;
    for (Py_ssize_t i = 0; i < count; i++) {
        blake2b_state s;
        b2_init(&s);
        b2_part(&s, (const uint8_t *)"B", 1);
        b2_part(&s, parent_at, parent_len);
        b2_part(&s, (const uint8_t *)packed.buf + i * width, (size_t)width);
        b2_final(&s, parent);
        parent_at = parent;
        parent_len = DIGEST;
        PyObject *digest = PyBytes_FromStringAndSize((const char *)parent, DIGEST);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, digest);
    }
done:
    PyBuffer_Release(&packed);
    return out;
}

static PyObject *tail_digests(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer packed;
    Py_ssize_t tail_start;
    PyObject *ends;
    const char *parent;
    Py_ssize_t parent_len;
    if (!PyArg_ParseTuple(args, "y*nOy#", &packed, &tail_start, &ends, &parent, &parent_len)) return NULL;
    PyObject *out = NULL, *seq = PySequence_Fast(ends, "ends must be a sequence of ints");
    if (seq == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    blake2b_state prefix;
    b2_init(&prefix);
    b2_part(&prefix, (const uint8_t *)"T", 1);
    b2_part(&prefix, (const uint8_t *)parent, (size_t)parent_len);
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t end = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (end == -1 && PyErr_Occurred()) goto fail;
        /* In tokens first: ``4 *`` an id count past the buffer could wrap around. */
        if (tail_start < 0 || end <= tail_start || end > packed.len / 4) {
            PyErr_Format(PyExc_ValueError, "tail end %zd is not inside the packed tokens after %zd", end, tail_start);
            goto fail;
        }
        blake2b_state s = prefix;
        uint8_t digest[DIGEST];
        b2_part(&s, (const uint8_t *)packed.buf + 4 * tail_start, (size_t)(4 * (end - tail_start)));
        b2_final(&s, digest);
        PyObject *item = PyBytes_FromStringAndSize((const char *)digest, DIGEST);
        if (item == NULL) goto fail;
        PyList_SET_ITEM(out, i, item);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&packed);
    return out;
}

/* A ref of ``ref_type`` (a tuple subclass: ObjectRef) from its seven fields, made as
 * ``tuple.__new__(ref_type, fields)`` makes it (the named tuple's own __new__ is a Python function); steals none. */
static PyObject *new_ref(PyTypeObject *ref_type, PyObject *fields[7]) {
    PyObject *items = PyTuple_Pack(7, fields[0], fields[1], fields[2], fields[3], fields[4], fields[5], fields[6]);
    if (items == NULL) return NULL;
    PyObject *args = PyTuple_Pack(1, items);
    Py_DECREF(items);
    if (args == NULL) return NULL;
    PyObject *ref = PyTuple_Type.tp_new(ref_type, args, NULL);
    Py_DECREF(args);
    return ref;
}

/* The ref of the tail or pointer ending at ``end``, kept in ``refs`` under ``where`` and in ``by_key``
 * under its key; a new reference, or NULL with an exception set. */
static PyObject *make_ref(PyTypeObject *ref_type, PyObject *prefix, PyObject *group, PyObject *kind,
                          Py_ssize_t block_size, PyObject *end, PyObject *hashes, PyObject *refs, PyObject *by_key,
                          PyObject *where) {
    PyObject *digest = PyDict_GetItemWithError(hashes, end);
    if (digest == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "no tail hash for end %R", end);
        return NULL;
    }
    /* Held: what follows allocates, a collection may run Python code, and another thread may replace
     * the dict's entry (with equal bytes: PromptKeys' rule) meanwhile. */
    Py_INCREF(digest);
    PyObject *key = NULL, *index_obj = NULL, *start = NULL, *ref = NULL;
    Py_ssize_t token_end = PyLong_AsSsize_t(end);
    if (token_end == -1 && PyErr_Occurred()) goto done;
    if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) > 64) {
        PyErr_Format(PyExc_ValueError, "the tail hash for end %R is not a digest", end);
        goto done;
    }
    char hex[129];
    const unsigned char *raw = (const unsigned char *)PyBytes_AS_STRING(digest);
    Py_ssize_t size = PyBytes_GET_SIZE(digest);
    for (Py_ssize_t j = 0; j < size; j++) {
        hex[2 * j] = "0123456789abcdef"[raw[j] >> 4];
        hex[2 * j + 1] = "0123456789abcdef"[raw[j] & 15];
    }
    hex[2 * size] = 0;
    Py_ssize_t index = token_end / block_size;
    key = PyUnicode_FromFormat("%U%zd/%s", prefix, token_end, hex);
    index_obj = PyLong_FromSsize_t(index);
    start = PyLong_FromSsize_t(index * block_size);
    if (key == NULL || index_obj == NULL || start == NULL) goto done;
    PyObject *fields[7] = {key, group, kind, index_obj, start, end, digest};
    ref = new_ref(ref_type, fields);
    if (ref != NULL && (PyDict_SetItem(refs, where, ref) < 0 || PyDict_SetItem(by_key, key, ref) < 0)) Py_CLEAR(ref);
done:
    Py_XDECREF(key);
    Py_XDECREF(index_obj);
    Py_XDECREF(start);
    Py_DECREF(digest);
    return ref;
}

static PyObject *build_refs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ref_type, *prefix, *group, *kind, *ends, *hashes, *refs, *by_key;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "O!UOOnOO!O!O!", &PyType_Type, &ref_type, &prefix, &group, &kind, &block_size, &ends,
                          &PyDict_Type, &hashes, &PyDict_Type, &refs, &PyDict_Type, &by_key))
        return NULL;
    if (block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)ref_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "ref_type must be a tuple type");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(ends, "ends must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *end = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *where = PyTuple_Pack(3, kind, end, group);
        if (where == NULL) goto fail;
        PyObject *ref = PyDict_GetItemWithError(refs, where); /* borrowed: held at once */
        if (ref != NULL)
            Py_INCREF(ref);
        else if (!PyErr_Occurred())
            ref = make_ref((PyTypeObject *)ref_type, prefix, group, kind, block_size, end, hashes, refs, by_key, where);
        Py_DECREF(where);
        if (ref == NULL) goto fail;
        PyList_SET_ITEM(out, i, ref);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef METHODS[] = {
    {"block_chain", block_chain, METH_VARARGS, "Chain hashes at the end of every full block of the packed tokens."},
    {"tail_digests", tail_digests, METH_VARARGS, "Tail hashes at each end, all inside the block starting at tail_start."},
    {"build_refs", build_refs, METH_VARARGS, "Tail or pointer refs at each end, made where not made yet, and kept."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_native", "kvtool's key builder in C.", -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&MODULE); }
