/*
 * arrow_outputs._speedups: the record-batch codec's walks over Python objects, in C.
 *
 * arrow_outputs/_pyspeedups.py is the specification: every function here gives the same
 * answer as its pure-Python twin for every input, and tests/test_speedups.py runs both
 * through the same tests. Each function either does the whole job or returns None (False
 * for index_in_order) so that the caller's slow path raises the precise error.
 *
 * Rules kept throughout:
 * - every type is checked before a macro that assumes it (PyList_GET_ITEM after
 *   PyList_CheckExact), every buffer length and offset is checked before it is read, and
 *   every total is checked before it could overflow;
 * - outputs are sized first, then filled, and the fill re-checks what it relies on;
 * - every acquired buffer is released on every path (one cleanup label per function);
 * - only index_in_order can run user code (__eq__), and it does so only on a path that
 *   works on its own references (see there); build_array's buffer requests may reach an
 *   exporter's code (Python 3.12's __buffer__), which cannot change the tuples it walks.
 *
 * build_array is the exception to "None on bad data": its nodes are built by the codec, not
 * read from the user, so a malformed node is a bug and raises TypeError / ValueError.
 *
 * Uses only the CPython C API. Compiles warning-free with -Wall -Wextra -Werror.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Arrow buffers here are little-endian and the code stores native integers; a big-endian
 * machine builds no extension (setup.py marks it optional) and runs the pure-Python path. */
#if !PY_LITTLE_ENDIAN
#error "arrow_outputs._speedups assumes a little-endian machine"
#endif

#define OFFSET_MAX ((Py_ssize_t)INT32_MAX) /* Arrow's int32 offsets */

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name,
                     expected, nargs);
        return 0;
    }
    return 1;
}

/* An integer argument as Py_ssize_t: TypeError for a non-integer, OverflowError past the
 * range (as _pyspeedups._ssize). Returns 0 with an exception set on failure. */
static int
ssize_arg(PyObject *obj, Py_ssize_t *out)
{
    Py_ssize_t v = PyNumber_AsSsize_t(obj, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) {
        return 0;
    }
    *out = v;
    return 1;
}

/* The raw bytes of a buffer-protocol object, as _pyspeedups._raw_bytes: asks for the same
 * buffer as memoryview() (PyBUF_FULL_RO) so exporters fail alike on both paths.
 * Returns 1 with `view` held (the caller releases it), 0 when the object cannot be used
 * (no buffer protocol, or not C-contiguous; nothing held, no exception), -1 on error. */
static int
get_bytes(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (view->len < 0 || (view->len > 0 && view->buf == NULL) ||
        !PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static inline int32_t
load_i32(const char *p, Py_ssize_t i)
{
    int32_t v;
    memcpy(&v, p + i * 4, 4); /* memcpy: Arrow buffers from user code need not be aligned */
    return v;
}

static inline void
store_i32(char *p, Py_ssize_t i, int32_t v)
{
    memcpy(p + i * 4, &v, 4);
}

/* Checks offsets[0 .. count) (count >= 1): the first >= 0, non-decreasing, the last <= limit.
 * The Arrow offsets passed here come from buffers of any origin, so nothing is assumed. */
static int
offsets_valid(const char *offs, Py_ssize_t count, Py_ssize_t limit)
{
    int32_t prev = load_i32(offs, 0);
    if (prev < 0) {
        return 0;
    }
    for (Py_ssize_t i = 1; i < count; i++) {
        int32_t cur = load_i32(offs, i);
        if (cur < prev) {
            return 0;
        }
        prev = cur;
    }
    return (Py_ssize_t)prev <= limit;
}

/* flatten_int_lists(lists, n, itemsize) -> (values, offsets) | None */
static PyObject *
flatten_int_lists(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *lists, *values = NULL, *offsets = NULL, *result = NULL;
    Py_ssize_t n, itemsize, total = 0, pos = 0;
    long long lo, hi;
    char *vbuf, *obuf;

    if (!check_nargs("flatten_int_lists", nargs, 3) || !ssize_arg(args[1], &n) ||
        !ssize_arg(args[2], &itemsize)) {
        return NULL;
    }
    lists = args[0];
    if (itemsize == 4) {
        lo = INT32_MIN;
        hi = INT32_MAX;
    }
    else if (itemsize == 8) {
        lo = LLONG_MIN;
        hi = LLONG_MAX;
    }
    else {
        Py_RETURN_NONE;
    }
    if (!PyList_CheckExact(lists) || PyList_GET_SIZE(lists) != n) {
        Py_RETURN_NONE;
    }
    /* Pass 1: the shape. No user code runs in either pass: exact lists and exact ints only. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(lists, i);
        if (!PyList_CheckExact(item)) {
            Py_RETURN_NONE;
        }
        if (PyList_GET_SIZE(item) > OFFSET_MAX - total) { /* subtracted: cannot overflow */
            Py_RETURN_NONE;
        }
        total += PyList_GET_SIZE(item);
    }
    /* (n + 1) * 4 cannot overflow for a list that exists, nor total * 8 for total <=
     * OFFSET_MAX on 64-bit; the checks keep 32-bit builds honest. */
    if (n > PY_SSIZE_T_MAX / 4 - 1 || total > PY_SSIZE_T_MAX / itemsize) {
        Py_RETURN_NONE;
    }
    values = PyBytes_FromStringAndSize(NULL, total * itemsize);
    offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
    if (values == NULL || offsets == NULL) {
        goto done;
    }
    vbuf = PyBytes_AS_STRING(values);
    obuf = PyBytes_AS_STRING(offsets);
    store_i32(obuf, 0, 0);
    /* Pass 2: the values. Re-check the list and the sizes pass 1 measured: the buffers were
     * sized from them. */
    if (!PyList_CheckExact(lists) || PyList_GET_SIZE(lists) != n) {
        goto none;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(lists, i);
        Py_ssize_t size;
        if (!PyList_CheckExact(item)) {
            goto none;
        }
        size = PyList_GET_SIZE(item);
        if (size > total - pos) {
            goto none;
        }
        for (Py_ssize_t j = 0; j < size; j++) {
            PyObject *v = PyList_GET_ITEM(item, j);
            int overflow;
            long long x;
            if (!PyLong_CheckExact(v)) { /* bool, int subclasses, floats: the slow path */
                goto none;
            }
            x = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (x == -1 && PyErr_Occurred()) {
                goto done;
            }
            if (overflow != 0 || x < lo || x > hi) {
                goto none;
            }
            if (itemsize == 4) {
                int32_t y = (int32_t)x;
                memcpy(vbuf + pos * 4, &y, 4);
            }
            else {
                int64_t y = (int64_t)x;
                memcpy(vbuf + pos * 8, &y, 8);
            }
            pos++;
        }
        store_i32(obuf, i + 1, (int32_t)pos); /* pos <= total <= OFFSET_MAX */
    }
    if (pos != total) {
        goto none;
    }
    result = PyTuple_Pack(2, values, offsets);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(values);
    Py_XDECREF(offsets);
    return result;
}

/* The UTF-8 form of an exact str: 1 with (*s, *len), 0 when it has none (a lone surrogate;
 * no exception left), -1 on error. PyUnicode_AsUTF8AndSize caches the form in the str, so
 * the second pass finds it again without encoding. */
static int
utf8_of(PyObject *str, const char **s, Py_ssize_t *len)
{
    *s = PyUnicode_AsUTF8AndSize(str, len);
    if (*s == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    return 1;
}

/* utf8_array(strs) -> (offsets, data) | None */
static PyObject *
utf8_array(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *strs, *offsets = NULL, *data = NULL, *result = NULL;
    Py_ssize_t n, total = 0, pos = 0, len;
    const char *s;
    char *obuf, *dbuf;
    int ok;

    if (!check_nargs("utf8_array", nargs, 1)) {
        return NULL;
    }
    strs = args[0];
    if (!PyList_CheckExact(strs)) {
        Py_RETURN_NONE;
    }
    n = PyList_GET_SIZE(strs);
    /* Pass 1: the sizes. No user code runs: exact strs only. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(strs, i);
        if (!PyUnicode_CheckExact(item)) {
            Py_RETURN_NONE;
        }
        ok = utf8_of(item, &s, &len);
        if (ok <= 0) {
            return ok < 0 ? NULL : Py_NewRef(Py_None);
        }
        if (len > OFFSET_MAX - total) {
            Py_RETURN_NONE;
        }
        total += len;
    }
    if (n > PY_SSIZE_T_MAX / 4 - 1) {
        Py_RETURN_NONE;
    }
    offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
    data = PyBytes_FromStringAndSize(NULL, total);
    if (offsets == NULL || data == NULL) {
        goto done;
    }
    obuf = PyBytes_AS_STRING(offsets);
    dbuf = PyBytes_AS_STRING(data);
    store_i32(obuf, 0, 0);
    /* Pass 2: the bytes, re-checking what the buffers were sized from. */
    if (PyList_GET_SIZE(strs) != n) {
        goto none;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(strs, i);
        if (!PyUnicode_CheckExact(item)) {
            goto none;
        }
        ok = utf8_of(item, &s, &len);
        if (ok < 0) {
            goto done;
        }
        if (ok == 0 || len > total - pos) {
            goto none;
        }
        memcpy(dbuf + pos, s, (size_t)len);
        pos += len;
        store_i32(obuf, i + 1, (int32_t)pos); /* pos <= total <= OFFSET_MAX */
    }
    if (pos != total) {
        goto none;
    }
    result = PyTuple_Pack(2, offsets, data);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(offsets);
    Py_XDECREF(data);
    return result;
}

/* The Python expression, evaluated through the C API exactly as the interpreter does:
 *     list(index) == req_ids and list(index.values()) == list(range(len(req_ids)))
 * User __eq__ may run here and may mutate req_ids or index: every object used is held by a
 * list this function owns (PyDict_Keys / PyDict_Values snapshot the dict like list() does),
 * and list_richcompare re-reads sizes after each call, as in Python. */
static PyObject *
index_in_order_generic(PyObject *req_ids, PyObject *index)
{
    PyObject *keys, *vals, *range, *cmp;
    Py_ssize_t n;
    int truth;

    keys = PyDict_Keys(index);
    if (keys == NULL) {
        return NULL;
    }
    cmp = PyObject_RichCompare(keys, req_ids, Py_EQ);
    Py_DECREF(keys);
    if (cmp == NULL) {
        return NULL;
    }
    truth = PyObject_IsTrue(cmp);
    Py_DECREF(cmp);
    if (truth <= 0) {
        return truth < 0 ? NULL : Py_NewRef(Py_False);
    }
    vals = PyDict_Values(index);
    if (vals == NULL) {
        return NULL;
    }
    n = PyList_GET_SIZE(req_ids); /* still an exact list: a list's __class__ is fixed */
    range = PyList_New(n);
    if (range == NULL) {
        Py_DECREF(vals);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL) {
            Py_DECREF(vals);
            Py_DECREF(range);
            return NULL;
        }
        PyList_SET_ITEM(range, i, v);
    }
    cmp = PyObject_RichCompare(vals, range, Py_EQ);
    Py_DECREF(vals);
    Py_DECREF(range);
    if (cmp == NULL) {
        return NULL;
    }
    truth = PyObject_IsTrue(cmp);
    Py_DECREF(cmp);
    if (truth < 0) {
        return NULL;
    }
    return Py_NewRef(truth ? Py_True : Py_False);
}

/* index_in_order(req_ids, index) -> bool
 *
 * The fast passes below read the dict with PyDict_Next and borrowed references, which is
 * safe only while no user code runs: they compare only pairs whose comparison cannot call
 * back into Python (the same object; two exact strs; an exact int against i) and hand any
 * other pair to index_in_order_generic, which starts over on owned references. Starting
 * over is exact: the comparisons already made had no side effects. Keys are all compared
 * before any value, as in the expression, so a value never decides before a key's __eq__
 * has run. */
static PyObject *
index_in_order(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *req_ids, *index, *key, *value;
    Py_ssize_t n, pos, i;

    if (!check_nargs("index_in_order", nargs, 2)) {
        return NULL;
    }
    req_ids = args[0];
    index = args[1];
    if (!PyList_CheckExact(req_ids) || !PyDict_CheckExact(index)) {
        Py_RETURN_FALSE;
    }
    n = PyList_GET_SIZE(req_ids);
    if (PyDict_GET_SIZE(index) != n) {
        Py_RETURN_FALSE; /* list_richcompare's first shortcut: the sizes differ */
    }
    pos = 0;
    i = 0;
    while (PyDict_Next(index, &pos, &key, NULL)) {
        PyObject *rid;
        int eq;
        if (i >= n) { /* cannot happen (sizes are equal, nothing runs); never read past */
            return index_in_order_generic(req_ids, index);
        }
        rid = PyList_GET_ITEM(req_ids, i);
        i++;
        if (key == rid) {
            continue;
        }
        if (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(rid)) {
            return index_in_order_generic(req_ids, index);
        }
        eq = PyObject_RichCompareBool(key, rid, Py_EQ); /* str == str: no user code */
        if (eq < 0) {
            return NULL;
        }
        if (!eq) {
            Py_RETURN_FALSE;
        }
    }
    pos = 0;
    i = 0;
    while (PyDict_Next(index, &pos, NULL, &value)) {
        int overflow;
        long long x;
        if (!PyLong_CheckExact(value)) { /* True, 0.0, numpy ints: their __eq__ decides */
            return index_in_order_generic(req_ids, index);
        }
        x = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (overflow != 0 || x != (long long)i) {
            Py_RETURN_FALSE;
        }
        i++;
    }
    Py_RETURN_TRUE;
}

/* str_list(offsets, data, offset, n) -> list[str] | None */
static PyObject *
str_list(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer obuf, dbuf;
    int have_o = 0, have_d = 0;
    Py_ssize_t offset, n;
    PyObject *result = NULL, *list = NULL;

    if (!check_nargs("str_list", nargs, 4) || !ssize_arg(args[2], &offset) ||
        !ssize_arg(args[3], &n)) {
        return NULL;
    }
    have_o = get_bytes(args[0], &obuf);
    if (have_o < 0) {
        return NULL;
    }
    have_d = get_bytes(args[1], &dbuf);
    if (have_d < 0) {
        goto done;
    }
    if (have_o == 0 || have_d == 0 || offset < 0 || n < 0) {
        goto none;
    }
    if (n == 0) {
        result = PyList_New(0);
        goto done;
    }
    /* offset + n + 1 entries needed; written so that nothing can overflow */
    if (obuf.len / 4 - offset < 1 || obuf.len / 4 - offset - 1 < n) {
        goto none;
    }
    {
        const char *offs = (const char *)obuf.buf + offset * 4;
        const char *data = (const char *)dbuf.buf;
        if (!offsets_valid(offs, n + 1, dbuf.len)) {
            goto none;
        }
        list = PyList_New(n);
        if (list == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t a = load_i32(offs, i), b = load_i32(offs, i + 1);
            /* An empty data buffer may have a NULL address: form no pointer from it. */
            PyObject *s = b > a ? PyUnicode_DecodeUTF8(data + a, (Py_ssize_t)b - a, "strict")
                                : PyUnicode_New(0, 0);
            if (s == NULL) {
                if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    PyErr_Clear();
                    goto none;
                }
                goto done;
            }
            PyList_SET_ITEM(list, i, s);
        }
        result = list;
        list = NULL;
        goto done;
    }
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(list);
    if (have_o > 0) {
        PyBuffer_Release(&obuf);
    }
    if (have_d > 0) {
        PyBuffer_Release(&dbuf);
    }
    return result;
}

/* split_int_lists(values, offsets, itemsize, n) -> list[list[int]] | None */
static PyObject *
split_int_lists(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer vbuf, obuf;
    int have_v = 0, have_o = 0;
    Py_ssize_t itemsize, n;
    PyObject *result = NULL, *outer = NULL;

    if (!check_nargs("split_int_lists", nargs, 4) || !ssize_arg(args[2], &itemsize) ||
        !ssize_arg(args[3], &n)) {
        return NULL;
    }
    have_v = get_bytes(args[0], &vbuf);
    if (have_v < 0) {
        return NULL;
    }
    have_o = get_bytes(args[1], &obuf);
    if (have_o < 0) {
        goto done;
    }
    if (have_v == 0 || have_o == 0 || (itemsize != 4 && itemsize != 8) || n < 0) {
        goto none;
    }
    if (n == 0) {
        result = PyList_New(0);
        goto done;
    }
    if (obuf.len / 4 - 1 < n) { /* n + 1 entries needed */
        goto none;
    }
    {
        const char *offs = (const char *)obuf.buf;
        const char *vals = (const char *)vbuf.buf;
        if (!offsets_valid(offs, n + 1, vbuf.len / itemsize)) {
            goto none;
        }
        outer = PyList_New(n);
        if (outer == NULL) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t a = load_i32(offs, i), b = load_i32(offs, i + 1);
            PyObject *inner = PyList_New(b - a);
            if (inner == NULL) {
                goto done;
            }
            PyList_SET_ITEM(outer, i, inner); /* the outer list owns it from here */
            for (Py_ssize_t j = a; j < b; j++) {
                PyObject *v;
                if (itemsize == 4) {
                    int32_t x;
                    memcpy(&x, vals + j * 4, 4);
                    v = PyLong_FromLong((long)x);
                }
                else {
                    int64_t x;
                    memcpy(&x, vals + j * 8, 8);
                    v = PyLong_FromLongLong((long long)x);
                }
                if (v == NULL) {
                    goto done;
                }
                PyList_SET_ITEM(inner, j - a, v);
            }
        }
        result = outer;
        outer = NULL;
        goto done;
    }
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(outer);
    if (have_v > 0) {
        PyBuffer_Release(&vbuf);
    }
    if (have_o > 0) {
        PyBuffer_Release(&obuf);
    }
    return result;
}

/* mask_rows(token_ids, width, packed, row_bytes, lens, vocab_size, out) -> bool
 *
 * The supports of sampling-mask rows, concatenated into `out` (int32): row r keeps its first
 * lens[r] compact ids when lens[r] <= width, else the set bits of its packed bitmask row
 * (little bit order, ids below vocab_size), which must number exactly lens[r]. False (and
 * `out` unspecified) when a buffer is too short, `out` is not exactly sum(lens) ids, a length
 * is negative, or a bitmask row disagrees with its count: the caller's numpy path then raises
 * the precise error. */
static PyObject *
mask_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer tbuf, pbuf, lbuf, obuf;
    int have_t = 0, have_p = 0, have_l = 0, have_o = 0, ok = 0;
    Py_ssize_t width, row_bytes, vocab;

    if (!check_nargs("mask_rows", nargs, 7) || !ssize_arg(args[1], &width) ||
        !ssize_arg(args[3], &row_bytes) || !ssize_arg(args[5], &vocab)) {
        return NULL;
    }
    if ((have_t = get_bytes(args[0], &tbuf)) < 0 || (have_p = get_bytes(args[2], &pbuf)) < 0 ||
        (have_l = get_bytes(args[4], &lbuf)) < 0) {
        goto done;
    }
    /* Asked read-only, as memoryview() asks, then refused when read-only: exporters answer
     * a writable request differently (numpy raises ValueError), the twin sees .readonly. */
    if ((have_o = get_bytes(args[6], &obuf)) < 0) {
        goto done;
    }
    if (!have_t || !have_p || !have_l || !have_o || obuf.readonly || width < 0 || row_bytes < 0 ||
        vocab < 0 ||
        row_bytes < (vocab + 7) / 8 || lbuf.len % 4 || obuf.len % 4) {
        goto answer;
    }
    {
        Py_ssize_t rows = lbuf.len / 4, cap = obuf.len / 4, pos = 0;
        const char *tok = (const char *)tbuf.buf, *lens = (const char *)lbuf.buf;
        const unsigned char *bits = (const unsigned char *)pbuf.buf;
        char *out = (char *)obuf.buf;
        if (width > 0 && tbuf.len / 4 / width < rows) {
            goto answer;
        }
        if (row_bytes > 0 && pbuf.len / row_bytes < rows) {
            goto answer;
        }
        for (Py_ssize_t r = 0; r < rows; r++) {
            Py_ssize_t n = load_i32(lens, r);
            if (n < 0 || n > cap - pos) {
                goto answer;
            }
            if (n <= width) {
                if (n > 0) { /* memcpy of 0 bytes may still not be given NULL */
                    memcpy(out + pos * 4, tok + (r * width) * 4, (size_t)n * 4);
                }
                pos += n;
                continue;
            }
            const unsigned char *row = bits + r * row_bytes;
            Py_ssize_t found = 0, nbytes = (vocab + 7) / 8;
            for (Py_ssize_t b = 0; b < nbytes; b++) {
                unsigned int byte = row[b];
                while (byte) {
                    Py_ssize_t id = b * 8 + __builtin_ctz(byte);
                    byte &= byte - 1;
                    if (id >= vocab) {
                        break;
                    }
                    if (found == n) {
                        goto answer; /* more set bits than the count */
                    }
                    store_i32(out, pos + found, (int32_t)id);
                    found++;
                }
            }
            if (found != n) {
                goto answer;
            }
            pos += n;
        }
        ok = pos == cap;
    }
answer:
    if (!PyErr_Occurred()) {
        PyObject *res = ok ? Py_True : Py_False;
        if (have_t > 0) PyBuffer_Release(&tbuf);
        if (have_p > 0) PyBuffer_Release(&pbuf);
        if (have_l > 0) PyBuffer_Release(&lbuf);
        if (have_o > 0) PyBuffer_Release(&obuf);
        return Py_NewRef(res);
    }
done:
    if (have_t > 0) PyBuffer_Release(&tbuf);
    if (have_p > 0) PyBuffer_Release(&pbuf);
    if (have_l > 0) PyBuffer_Release(&lbuf);
    if (have_o > 0) PyBuffer_Release(&obuf);
    return NULL;
}

/* same_items(a, b) -> bool
 *
 * Whether a and b are exact lists of the same length holding the very same objects, in
 * order (identity, never __eq__: no user code runs). The codec reuses a run's last request-id
 * column when a step's req_ids are the last step's objects. */
static PyObject *
same_items(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *a, *b;
    Py_ssize_t n;

    if (!check_nargs("same_items", nargs, 2)) {
        return NULL;
    }
    a = args[0];
    b = args[1];
    if (!PyList_CheckExact(a) || !PyList_CheckExact(b)) {
        Py_RETURN_FALSE;
    }
    n = PyList_GET_SIZE(a);
    if (PyList_GET_SIZE(b) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(a, i) != PyList_GET_ITEM(b, i)) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* int_offsets(values, last) -> bytes | None
 *
 * int32 Arrow offsets from a Python list (or tuple) of exact ints that start at 0, never
 * decrease and end at `last` (<= INT32_MAX): cu_num_generated_tokens as vLLM hands it over.
 * None for anything else (a bool, a float, a decrease, the wrong end, too long): the caller's
 * numpy path then raises the precise error. No user code runs: exact ints only. */
static PyObject *
int_offsets(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *out;
    PyObject **items;
    Py_ssize_t n, last;
    long long prev = 0;
    char *obuf;

    if (!check_nargs("int_offsets", nargs, 2) || !ssize_arg(args[1], &last)) {
        return NULL;
    }
    seq = args[0];
    if (PyList_CheckExact(seq)) {
        items = ((PyListObject *)seq)->ob_item;
        n = PyList_GET_SIZE(seq);
    }
    else if (PyTuple_CheckExact(seq)) {
        items = ((PyTupleObject *)seq)->ob_item;
        n = PyTuple_GET_SIZE(seq);
    }
    else {
        Py_RETURN_NONE;
    }
    if (n < 1 || last < 0 || last > OFFSET_MAX || n > PY_SSIZE_T_MAX / 4) {
        Py_RETURN_NONE;
    }
    /* Sized first (from n), then one pass that checks and fills; the allocation runs no
     * Python code, and the pass re-reads the list's size and items, so nothing read can have
     * changed under it. */
    out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    obuf = PyBytes_AS_STRING(out);
    if (PyList_CheckExact(seq)) {
        items = ((PyListObject *)seq)->ob_item;
        if (PyList_GET_SIZE(seq) != n) {
            goto none;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        int overflow;
        long long x;
        if (!PyLong_CheckExact(v)) {
            goto none;
        }
        x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (overflow != 0 || (i == 0 && x != 0) || x < prev || x > (long long)last) {
            goto none;
        }
        prev = x;
        store_i32(obuf, i, (int32_t)x); /* within 0..last <= INT32_MAX */
    }
    if (prev != (long long)last) {
        goto none;
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ Arrow C Data Interface
 *
 * build_array(node) -> (capsule, address)
 *
 * A whole record batch's ArrowArray tree, assembled in one call from a tree of nodes
 *     node = (length, null_count, buffers, children)
 * where `buffers` is a tuple of None or objects with the buffer protocol (bytes, numpy arrays,
 * pyarrow Buffers) and `children` a tuple of nodes. No data is copied: every buffer pointer
 * is the object's own memory, and the object is held (a Py_buffer) until Arrow releases the
 * array. The caller imports it with pyarrow.RecordBatch._import_from_c(address, schema) and
 * validates it as from_buffers would; the capsule releases the tree if it was never imported.
 *
 * Checked here: the exact type and arity of every tuple, lengths and null counts within
 * 0..INT64 (null_count <= length), the tree's depth and size, C-contiguous buffers. The
 * buffers' sizes against the type are checked by pyarrow's validate() after the import
 * (only the schema knows the type).
 *
 * Memory: one block per tree (PyMem_Raw: freed from any thread) holds every ArrowArray, the
 * pointer arrays and the Py_buffers, with a reference count of one per node plus one for the
 * capsule. Releasing a node releases its unreleased children, then drops its reference; the
 * last reference gives the buffers back under the GIL and frees the block. So a consumer may
 * move children out and release them in any order, as the interface allows. */

#ifndef ARROW_C_DATA_INTERFACE
#define ARROW_C_DATA_INTERFACE
struct ArrowSchema;
struct ArrowArray {
    int64_t length;
    int64_t null_count;
    int64_t offset;
    int64_t n_buffers;
    int64_t n_children;
    const void **buffers;
    struct ArrowArray **children;
    struct ArrowArray *dictionary;
    void (*release)(struct ArrowArray *);
    void *private_data;
};
#endif

#define TREE_MAX_DEPTH 64
#define TREE_MAX_NODES 65536
#define NODE_MAX_BUFFERS 8

typedef struct {
    Py_ssize_t refs; /* atomic */
    Py_ssize_t n_views;
    Py_buffer *views;
} ArrayBlock;

static void
block_decref(ArrayBlock *b)
{
    if (__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0) {
        return;
    }
    /* At interpreter exit the objects are gone with the interpreter: leave them. */
    if (b->n_views > 0 && Py_IsInitialized()) {
        PyGILState_STATE st = PyGILState_Ensure();
        for (Py_ssize_t i = 0; i < b->n_views; i++) {
            PyBuffer_Release(&b->views[i]);
        }
        PyGILState_Release(st);
    }
    PyMem_RawFree(b);
}

static void
release_node(struct ArrowArray *a)
{
    if (a == NULL || a->release == NULL) {
        return;
    }
    for (int64_t i = 0; i < a->n_children; i++) {
        struct ArrowArray *c = a->children[i];
        if (c != NULL && c->release != NULL) {
            c->release(c);
        }
    }
    a->release = NULL;
    block_decref((ArrayBlock *)a->private_data);
}

typedef struct {
    Py_ssize_t nodes, children, buffers, views;
} TreeSize;

/* Pass 1: check the tree's shape and count what it needs. */
static int
tree_measure(PyObject *node, int depth, TreeSize *sz)
{
    PyObject *bufs, *kids;
    if (depth > TREE_MAX_DEPTH) {
        PyErr_SetString(PyExc_ValueError, "build_array: nodes nested too deep");
        return 0;
    }
    if (!PyTuple_CheckExact(node) || PyTuple_GET_SIZE(node) != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "build_array: a node is a tuple (length, null_count, buffers, children)");
        return 0;
    }
    bufs = PyTuple_GET_ITEM(node, 2);
    kids = PyTuple_GET_ITEM(node, 3);
    if (!PyLong_CheckExact(PyTuple_GET_ITEM(node, 0)) ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(node, 1)) || !PyTuple_CheckExact(bufs) ||
        !PyTuple_CheckExact(kids)) {
        PyErr_SetString(PyExc_TypeError,
                        "build_array: a node is (int, int, tuple of buffers, tuple of nodes)");
        return 0;
    }
    if (++sz->nodes > TREE_MAX_NODES) {
        PyErr_SetString(PyExc_ValueError, "build_array: too many nodes");
        return 0;
    }
    if (PyTuple_GET_SIZE(bufs) > NODE_MAX_BUFFERS) { /* Arrow's layouts have at most 3 */
        PyErr_SetString(PyExc_ValueError, "build_array: too many buffers in a node");
        return 0;
    }
    sz->buffers += PyTuple_GET_SIZE(bufs);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bufs); i++) {
        if (PyTuple_GET_ITEM(bufs, i) != Py_None) {
            sz->views++;
        }
    }
    sz->children += PyTuple_GET_SIZE(kids);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kids); i++) {
        if (!tree_measure(PyTuple_GET_ITEM(kids, i), depth + 1, sz)) {
            return 0;
        }
    }
    return 1;
}

typedef struct {
    ArrayBlock *block;
    struct ArrowArray *arrays;
    struct ArrowArray **child_ptrs;
    const void **buf_ptrs;
    TreeSize cap, used;
} TreeFill;

/* Pass 2: fill node `a` from `node` (shape proven by pass 1; the counts are re-checked
 * against the capacity all the same). */
static int
tree_fill(PyObject *node, struct ArrowArray *a, TreeFill *f)
{
    PyObject *bufs = PyTuple_GET_ITEM(node, 2), *kids = PyTuple_GET_ITEM(node, 3);
    Py_ssize_t nb = PyTuple_GET_SIZE(bufs), nk = PyTuple_GET_SIZE(kids);
    long long length = PyLong_AsLongLong(PyTuple_GET_ITEM(node, 0));
    long long nulls;
    if (length == -1 && PyErr_Occurred()) {
        return 0;
    }
    nulls = PyLong_AsLongLong(PyTuple_GET_ITEM(node, 1));
    if (nulls == -1 && PyErr_Occurred()) {
        return 0;
    }
    if (length < 0 || nulls < 0 || nulls > length) {
        PyErr_Format(PyExc_ValueError,
                     "build_array: length %lld and null_count %lld (expected 0 <= null_count "
                     "<= length)",
                     length, nulls);
        return 0;
    }
    if (nb > f->cap.buffers - f->used.buffers || nk > f->cap.children - f->used.children) {
        PyErr_SetString(PyExc_RuntimeError, "build_array: the tree changed while read");
        return 0;
    }
    a->length = length;
    a->null_count = nulls;
    a->offset = 0;
    a->n_buffers = nb;
    a->n_children = nk;
    a->buffers = f->buf_ptrs + f->used.buffers;
    a->children = f->child_ptrs + f->used.children;
    a->dictionary = NULL;
    a->release = NULL; /* set by the caller once the whole tree is filled */
    a->private_data = f->block;
    f->used.buffers += nb;
    f->used.children += nk;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *obj = PyTuple_GET_ITEM(bufs, i);
        Py_buffer *view;
        if (obj == Py_None) {
            a->buffers[i] = NULL;
            continue;
        }
        if (f->used.views >= f->cap.views) {
            PyErr_SetString(PyExc_RuntimeError, "build_array: the tree changed while read");
            return 0;
        }
        view = &f->block->views[f->used.views];
        if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
            return 0;
        }
        f->used.views++;
        f->block->n_views = f->used.views; /* released on every path from here */
        a->buffers[i] = view->buf;
    }
    for (Py_ssize_t i = 0; i < nk; i++) {
        struct ArrowArray *child;
        if (f->used.nodes >= f->cap.nodes) {
            PyErr_SetString(PyExc_RuntimeError, "build_array: the tree changed while read");
            return 0;
        }
        child = &f->arrays[f->used.nodes++];
        a->children[i] = child;
        if (!tree_fill(PyTuple_GET_ITEM(kids, i), child, f)) {
            return 0;
        }
    }
    return 1;
}

static void
array_capsule_destructor(PyObject *capsule)
{
    struct ArrowArray *root = PyCapsule_GetPointer(capsule, "arrow_outputs.array");
    if (root == NULL) {
        PyErr_Clear();
        return;
    }
    ArrayBlock *block = (ArrayBlock *)root->private_data;
    release_node(root); /* never imported (or imported: moved out, release is NULL) */
    block_decref(block);
}

static PyObject *
build_array(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    TreeSize sz = {0, 0, 0, 0};
    TreeFill f;
    size_t bytes;
    char *mem;
    PyObject *capsule, *address, *result;

    if (!check_nargs("build_array", nargs, 1) || !tree_measure(args[0], 0, &sz)) {
        return NULL;
    }
    /* Counts are bounded by TREE_MAX_NODES nodes of tuples that exist: no overflow. */
    bytes = sizeof(ArrayBlock) + (size_t)sz.nodes * sizeof(struct ArrowArray) +
            (size_t)sz.children * sizeof(struct ArrowArray *) +
            (size_t)sz.buffers * sizeof(void *) + (size_t)sz.views * sizeof(Py_buffer);
    mem = PyMem_RawCalloc(1, bytes);
    if (mem == NULL) {
        return PyErr_NoMemory();
    }
    f.block = (ArrayBlock *)mem;
    f.arrays = (struct ArrowArray *)(mem + sizeof(ArrayBlock));
    f.child_ptrs = (struct ArrowArray **)(f.arrays + sz.nodes);
    f.buf_ptrs = (const void **)(f.child_ptrs + sz.children);
    f.block->views = (Py_buffer *)(f.buf_ptrs + sz.buffers);
    f.block->n_views = 0;
    f.block->refs = 1; /* the fill's own, until the tree is whole */
    f.cap = sz;
    f.used = (TreeSize){1, 0, 0, 0};
    if (!tree_fill(args[0], &f.arrays[0], &f) || f.used.nodes != sz.nodes) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "build_array: the tree changed while read");
        }
        for (Py_ssize_t i = 0; i < f.block->n_views; i++) {
            PyBuffer_Release(&f.block->views[i]);
        }
        PyMem_RawFree(mem);
        return NULL;
    }
    /* Whole: one reference per node, plus the capsule's (dropped by its destructor). */
    f.block->refs = sz.nodes + 1;
    for (Py_ssize_t i = 0; i < sz.nodes; i++) {
        f.arrays[i].release = release_node;
    }
    capsule = PyCapsule_New(&f.arrays[0], "arrow_outputs.array", array_capsule_destructor);
    if (capsule == NULL) {
        release_node(&f.arrays[0]);
        block_decref(f.block);
        return NULL;
    }
    address = PyLong_FromVoidPtr(&f.arrays[0]);
    if (address == NULL) {
        Py_DECREF(capsule);
        return NULL;
    }
    result = PyTuple_Pack(2, capsule, address);
    Py_DECREF(capsule);
    Py_DECREF(address);
    return result;
}

static PyMethodDef speedups_methods[] = {
    {"flatten_int_lists", (PyCFunction)(void (*)(void))flatten_int_lists, METH_FASTCALL,
     "flatten_int_lists(lists, n, itemsize, /)\n--\n\n"
     "(values, offsets) bytes of an Arrow list array, or None (see _pyspeedups)."},
    {"utf8_array", (PyCFunction)(void (*)(void))utf8_array, METH_FASTCALL,
     "utf8_array(strs, /)\n--\n\n"
     "(offsets, data) bytes of an Arrow string array, or None (see _pyspeedups)."},
    {"index_in_order", (PyCFunction)(void (*)(void))index_in_order, METH_FASTCALL,
     "index_in_order(req_ids, index, /)\n--\n\n"
     "Whether index maps req_ids[i] to i in order (see _pyspeedups)."},
    {"str_list", (PyCFunction)(void (*)(void))str_list, METH_FASTCALL,
     "str_list(offsets, data, offset, n, /)\n--\n\n"
     "The strs of an Arrow string array's buffers, or None (see _pyspeedups)."},
    {"split_int_lists", (PyCFunction)(void (*)(void))split_int_lists, METH_FASTCALL,
     "split_int_lists(values, offsets, itemsize, n, /)\n--\n\n"
     "The lists of ints of an Arrow list array's buffers, or None (see _pyspeedups)."},
    {"mask_rows", (PyCFunction)(void (*)(void))mask_rows, METH_FASTCALL,
     "Sampling-mask rows' supports into an int32 buffer (see _pyspeedups.mask_rows)."},
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(a, b, /)\n--\n\n"
     "Whether two exact lists hold the same objects in order (see _pyspeedups)."},
    {"int_offsets", (PyCFunction)(void (*)(void))int_offsets, METH_FASTCALL,
     "int_offsets(values, last, /)\n--\n\n"
     "int32 offsets bytes of a list of ints from 0 to last, or None (see _pyspeedups)."},
    {"build_array", (PyCFunction)(void (*)(void))build_array, METH_FASTCALL,
     "build_array(node, /)\n--\n\n"
     "(capsule, address) of an ArrowArray tree over the nodes' buffers (see batch.py)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot speedups_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    /* build_array's release callback takes the GIL with PyGILState_Ensure, which knows only
     * the main interpreter: the module is for one interpreter (as pyarrow is). */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* The GIL is needed: the walks read lists and dicts through borrowed references. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "arrow_outputs._speedups",
    .m_doc = "Compiled twin of arrow_outputs._pyspeedups (the specification).",
    .m_size = 0,
    .m_methods = speedups_methods,
    .m_slots = speedups_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
