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

/* For the few helpers called once per row of a hot loop, where gcc's heuristics leave a call
 * (and its spills) that costs as much as the helper's work. */
#if defined(__GNUC__)
#define AO_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define AO_ALWAYS_INLINE inline
#endif

/* The value of an exact int that fits one internal digit (|v| < 2**30: token ids, request
 * indexes), read inline: 1 with *out set, 0 for any other int (the caller then asks
 * PyLong_AsLongLongAndOverflow). Saves a call per item in the loops over Python ints.
 * Python 3.12 made the layout private and gave these two accessors for it. */
#if PY_VERSION_HEX >= 0x030C0000
static AO_ALWAYS_INLINE int
compact_long(PyObject *v, long long *out)
{
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        return 0;
    }
    *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)v);
    return 1;
}
#else
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* Python.h includes it from 3.11 on */
#endif
static AO_ALWAYS_INLINE int
compact_long(PyObject *v, long long *out)
{
    Py_ssize_t size = Py_SIZE(v); /* signed digit count: 0 for zero */
    if (size < -1 || size > 1) {
        return 0;
    }
    *out = size * (long long)((PyLongObject *)v)->ob_digit[0];
    return 1;
}
#endif

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
            if (!compact_long(v, &x)) {
                x = PyLong_AsLongLongAndOverflow(v, &overflow);
                if (x == -1 && PyErr_Occurred()) {
                    goto done;
                }
                if (overflow != 0) {
                    goto none;
                }
            }
            if (x < lo || x > hi) {
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
    /* An ASCII str's characters are its UTF-8 form, stored inline: no call, no cache. */
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_IS_READY(str) && PyUnicode_IS_COMPACT_ASCII(str)) {
#else
    if (PyUnicode_IS_COMPACT_ASCII(str)) {
#endif
        *s = (const char *)PyUnicode_DATA(str);
        *len = PyUnicode_GET_LENGTH(str);
        return 1;
    }
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

/* utf8_of for strs[i] (strs an exact list, i in range): 0 when it is not an exact str. */
static AO_ALWAYS_INLINE int
item_utf8(PyObject *strs, Py_ssize_t i, const char **s, Py_ssize_t *len)
{
    PyObject *item = PyList_GET_ITEM(strs, i);
    return PyUnicode_CheckExact(item) ? utf8_of(item, s, len) : 0;
}

/* utf8_array(strs) -> (offsets, data) | None
 *
 * One pass over the strs for ids of one length, as vLLM's are (each id read once: a step's
 * ids are scattered objects): the data buffer is sized from the first id. An id that does
 * not fit has the rest measured first (types and the int32 total checked before anything
 * large is allocated), and the buffer is sized exactly for them; it is trimmed at the end.
 * No user code runs: exact strs only, and nothing here calls back into Python. */
static PyObject *
utf8_array(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *strs, *offsets = NULL, *data = NULL, *result = NULL;
    Py_ssize_t n, total = 0, cap, len;
    const char *s;
    char *obuf;
    int ok;

    if (!check_nargs("utf8_array", nargs, 1)) {
        return NULL;
    }
    strs = args[0];
    if (!PyList_CheckExact(strs)) {
        Py_RETURN_NONE;
    }
    n = PyList_GET_SIZE(strs);
    if (n > PY_SSIZE_T_MAX / 4 - 1) {
        Py_RETURN_NONE;
    }
    /* A first guess that fits ids of the first one's length (bounded: an odd first id asks
     * for no more than 257 bytes per id, and never more than int32 offsets can reach). */
    cap = 64;
    if (n > 0) {
        ok = item_utf8(strs, 0, &s, &len);
        if (ok < 0) {
            return NULL;
        }
        if (ok > 0 && len <= 256 && n <= (OFFSET_MAX - cap) / (len + 1)) {
            cap += n * (len + 1);
        }
    }
    offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
    data = PyBytes_FromStringAndSize(NULL, cap);
    if (offsets == NULL || data == NULL) {
        goto done;
    }
    obuf = PyBytes_AS_STRING(offsets);
    store_i32(obuf, 0, 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        ok = item_utf8(strs, i, &s, &len);
        if (ok < 0) {
            goto done;
        }
        if (ok == 0 || len > OFFSET_MAX - total) {
            goto none;
        }
        if (len > cap - total) { /* the rest measured, then the buffer sized for them */
            Py_ssize_t need = total + len;
            for (Py_ssize_t j = i + 1; j < n; j++) {
                const char *sj;
                Py_ssize_t lj;
                ok = item_utf8(strs, j, &sj, &lj);
                if (ok < 0) {
                    goto done;
                }
                if (ok == 0 || lj > OFFSET_MAX - need) {
                    goto none;
                }
                need += lj;
            }
            if (_PyBytes_Resize(&data, need) < 0) { /* frees data and sets it NULL */
                goto done;
            }
            cap = need;
            if (len > cap - total) { /* cannot happen (nothing ran since); never write past */
                goto none;
            }
        }
        memcpy(PyBytes_AS_STRING(data) + total, s, (size_t)len);
        total += len;
        store_i32(obuf, i + 1, (int32_t)total); /* total <= OFFSET_MAX */
    }
    if (total < cap && _PyBytes_Resize(&data, total) < 0) {
        goto done;
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

/* copy_from_address(dst, offset, address, nbytes) -> bool
 *
 * memmove of nbytes bytes from the raw host address into the writable buffer dst at
 * offset: the staging pool's copy of a contiguous CPU tensor (address its data_ptr()) into
 * its slab, a tenth of the cost of ctypes.memmove's foreign call. The source is the caller's
 * to vouch for, as with ctypes; the destination is checked: False, with nothing written,
 * when dst is not a writable contiguous buffer or the range does not lie inside it. */
static PyObject *
copy_from_address(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    Py_ssize_t offset, nbytes;
    unsigned long long address;
    PyObject *index;
    int ok;

    if (!check_nargs("copy_from_address", nargs, 4) || !ssize_arg(args[1], &offset)) {
        return NULL;
    }
    index = PyNumber_Index(args[2]);
    if (index == NULL) {
        return NULL;
    }
    address = PyLong_AsUnsignedLongLong(index); /* OverflowError below 0 or past 64 bits */
    Py_DECREF(index);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!ssize_arg(args[3], &nbytes)) {
        return NULL;
    }
    if (address > (unsigned long long)UINTPTR_MAX) {
        Py_RETURN_FALSE;
    }
    /* The buffer memoryview() asks for, so exporters fail alike on both paths. */
    if (PyObject_GetBuffer(args[0], &view, PyBUF_FULL_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        return NULL;
    }
    ok = !view.readonly && PyBuffer_IsContiguous(&view, 'C') && offset >= 0 && nbytes >= 0 &&
         offset <= view.len - nbytes && (nbytes == 0 || (address != 0 && view.buf != NULL));
    if (ok && nbytes > 0) {
        memmove((char *)view.buf + offset, (const void *)(uintptr_t)address, (size_t)nbytes);
    }
    PyBuffer_Release(&view);
    return Py_NewRef(ok ? Py_True : Py_False);
}

/* A dict's entries read in place, in insertion order, on CPython 3.11: 8 instructions an entry
 * against about 75 through PyDict_Next, for index_in_order's everyday pass (1024 requests:
 * about a tenth of a device step's instructions). The keys object below mirrors
 * Include/internal/pycore_dict.h of 3.11, which no 3.11 release changes (PyDictObject itself
 * is public); dict_layout_ok() proves the mirror on this interpreter once, against
 * PyDict_Next, before it is trusted. Other versions take PyDict_Next. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define AO_DICT_TABLE 1
typedef struct {
    Py_ssize_t dk_refcnt;
    uint8_t dk_log2_size;
    uint8_t dk_log2_index_bytes;
    uint8_t dk_kind; /* 0 general (hash, key, value), 1 unicode (key, value), 2 split */
    uint32_t dk_version;
    Py_ssize_t dk_usable;
    Py_ssize_t dk_nentries;
    char dk_indices[];
} AoDictKeys311;

/* The first entry's key slot and the stride between entries (in pointers; the value follows
 * its key) of an exact dict that is one combined table without deleted entries, so that its
 * entries 0 .. len-1 are its items in order, none empty: 1, or 0 for any other dict. */
static int
dict_table(PyObject *d, PyObject ***slots, Py_ssize_t *stride)
{
    PyDictObject *mp = (PyDictObject *)d;
    AoDictKeys311 *dk = (AoDictKeys311 *)mp->ma_keys;
    char *entries;
    if (mp->ma_values != NULL || dk == NULL || dk->dk_nentries != mp->ma_used ||
        dk->dk_kind > 1 || dk->dk_log2_index_bytes > 8 * sizeof(Py_ssize_t) - 2) {
        return 0;
    }
    entries = dk->dk_indices + ((size_t)1 << dk->dk_log2_index_bytes);
    *stride = dk->dk_kind == 1 ? 2 : 3;
    *slots = (PyObject **)entries + (dk->dk_kind == 1 ? 0 : 1); /* general: past me_hash */
    return 1;
}

/* Whether dict_table reads dicts of both kinds as PyDict_Next does here (checked once). */
static int
dict_layout_ok(void)
{
    static int ok = -1;
    if (ok < 0) {
        PyObject *d[2] = {PyDict_New(), PyDict_New()}, *key, *value;
        ok = d[0] != NULL && d[1] != NULL;
        for (int kind = 0; kind < 2 && ok; kind++) {
            for (long i = 0; i < 40 && ok; i++) { /* past a resize or two */
                PyObject *k = kind ? PyUnicode_FromFormat("k%ld", i) : PyLong_FromLong(1000 + i);
                PyObject *v = PyLong_FromLong(i);
                ok = k != NULL && v != NULL && PyDict_SetItem(d[kind], k, v) == 0;
                Py_XDECREF(k);
                Py_XDECREF(v);
            }
            PyObject **slots;
            Py_ssize_t stride, pos = 0, j = 0;
            ok = ok && dict_table(d[kind], &slots, &stride) && stride == (kind ? 2 : 3);
            while (ok && PyDict_Next(d[kind], &pos, &key, &value)) {
                ok = slots[j * stride] == key && slots[j * stride + 1] == value;
                j++;
            }
            ok = ok && j == 40;
        }
        Py_XDECREF(d[0]);
        Py_XDECREF(d[1]);
        PyErr_Clear(); /* a failed allocation here only turns the fast read off */
    }
    return ok;
}
#endif

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
    /* One pass for what vLLM hands over: the dict built from req_ids itself (each key the
     * list's own object) with exact ints in order. Nothing here can run user code or
     * decide anything but "true": any other pair goes to the two passes below. */
    {
        int table_read = 0;
#ifdef AO_DICT_TABLE
        PyObject **slots;
        Py_ssize_t stride;
        if (dict_layout_ok() && dict_table(index, &slots, &stride)) {
            /* The same pass over the entries in place (see dict_table); a mismatch here is
             * one there too, so the PyDict_Next pass is not run again. */
            table_read = 1;
            for (i = 0; i < n; i++) {
                PyObject **entry = slots + i * stride;
                long long x;
                if (entry[0] != PyList_GET_ITEM(req_ids, i) || !PyLong_CheckExact(entry[1]) ||
                    !compact_long(entry[1], &x) || x != (long long)i) {
                    break;
                }
            }
        }
#endif
        if (!table_read) {
            pos = 0;
            i = 0;
            while (i < n && PyDict_Next(index, &pos, &key, &value)) {
                long long x;
                if (key != PyList_GET_ITEM(req_ids, i) || !PyLong_CheckExact(value) ||
                    !compact_long(value, &x) || x != (long long)i) {
                    break;
                }
                i++;
            }
        }
    }
    if (i == n) {
        Py_RETURN_TRUE;
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

/* A filled list of ints leaves the cycle collector: it can be in no reference cycle (CPython
 * untracks tuples and dicts of atomic values alike), and a step's rows are most of the
 * containers its decode makes, one per request, and the collections they set off cost a
 * 1024-request decode about half again its own time with the collector on (docs/accelerator.md). */
static void
untrack_int_list(PyObject *list)
{
    PyObject_GC_UnTrack(list);
}

/* Element j of an int32 (itemsize 4) or int64 buffer as a Python int (unaligned-safe). */
static PyObject *
int_at(const char *vals, Py_ssize_t itemsize, Py_ssize_t j)
{
    if (itemsize == 4) {
        int32_t x;
        memcpy(&x, vals + j * 4, 4);
        return PyLong_FromLong((long)x);
    }
    int64_t x;
    memcpy(&x, vals + j * 8, 8);
    return PyLong_FromLongLong((long long)x);
}

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
                PyObject *v = int_at(vals, itemsize, j);
                if (v == NULL) {
                    goto done;
                }
                PyList_SET_ITEM(inner, j - a, v);
            }
            untrack_int_list(inner);
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

/* ----------------------------------------------------------------------------- masks
 *
 * Sampling-mask supports (arrow_outputs/mask_tensors.py): compact rows are copied, wide rows
 * are read from their packed bitmask a 64-bit word at a time. */

/* Set bits of a word. Portable SWAR: the extension is built for baseline x86-64, where
 * __builtin_popcountll is a library call (no popcnt instruction without -mpopcnt). */
static inline int
popcount64(uint64_t x)
{
    x = x - ((x >> 1) & UINT64_C(0x5555555555555555));
    x = (x & UINT64_C(0x3333333333333333)) + ((x >> 2) & UINT64_C(0x3333333333333333));
    x = (x + (x >> 4)) & UINT64_C(0x0F0F0F0F0F0F0F0F);
    return (int)((x * UINT64_C(0x0101010101010101)) >> 56);
}

/* Index of the lowest set bit; 63 for 0 (__builtin_ctzll(0) is undefined, and OR-ing bit 63
 * never changes the answer for a non-zero word). */
static inline int32_t
low_bit(uint64_t x)
{
    return (int32_t)__builtin_ctzll(x | (UINT64_C(1) << 63));
}

/* Writes the ids of the set bits among the first `vocab` bits of `row` (little bit order)
 * to out[0 ..) as int32, ascending, and returns how many there are; -1 (out unspecified) as
 * soon as there are more than `n`. `room` (>= n) is how many ids `out` can take: while 8
 * slots remain, a word's first 8 ids are written without looking at its bit count (slots
 * past its last id get garbage, which the caller overwrites or drops), so a word costs no
 * data-dependent branch unless it has more than 8 bits. vocab <= 2**31. */
__attribute__((noinline)) /* keeps the row loops' registers free: wide rows are few */
static Py_ssize_t
bits_to_ids(const unsigned char *row, Py_ssize_t vocab, char *out, Py_ssize_t n,
            Py_ssize_t room)
{
    Py_ssize_t found = 0, full = vocab / 64, rest = vocab % 64;
    for (Py_ssize_t w = 0; w <= full; w++) {
        uint64_t word = 0;
        if (w < full) {
            memcpy(&word, row + w * 8, 8); /* memcpy: rows need not be aligned */
        }
        else if (rest) {
            memcpy(&word, row + w * 8, (size_t)((rest + 7) / 8));
            word &= (UINT64_C(1) << rest) - 1; /* bits past vocab_size are ignored */
        }
        if (!word) {
            continue;
        }
        int cnt = popcount64(word);
        if (cnt > n - found) {
            return -1;
        }
        int32_t base = (int32_t)(w * 64);
        char *o = out + found * 4;
        if (room - found >= 8) {
            for (int i = 0; i < 8; i++) {
                store_i32(o, i, base + low_bit(word));
                word &= word - 1;
            }
            for (int i = 8; i < cnt; i++) {
                store_i32(o, i, base + low_bit(word));
                word &= word - 1;
            }
        }
        else {
            for (int i = 0; i < cnt; i++) {
                store_i32(o, i, base + low_bit(word));
                word &= word - 1;
            }
        }
        found += cnt;
    }
    return found;
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
        vocab < 0 || row_bytes < (vocab + 7) / 8 || lbuf.len % 4 || obuf.len % 4) {
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
            }
            else if (bits_to_ids(bits + r * row_bytes, vocab, out + pos * 4, n, cap - pos) != n) {
                goto answer; /* more or fewer set bits than the count */
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

/* The element kind of a typed buffer's format: 'i' signed integer, 'u' unsigned integer, 0
 * anything else (several items, non-native byte order, floats). As _pyspeedups._format_kind. */
static char
format_kind(const Py_buffer *view)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '@' || *f == '=' || *f == '<') {
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0') {
        return 0;
    }
    if (strchr("bhilqn", f[0]) != NULL) {
        return 'i';
    }
    if (strchr("BHILQN", f[0]) != NULL) {
        return 'u';
    }
    return 0;
}

/* A C-contiguous integer buffer of `ndim` dimensions whose items are `itemsize` bytes of
 * kind `kind` ('i' or 'u'). Returns 1 with `view` held (the caller releases it), 0 when the
 * object does not qualify (nothing held, no exception), -1 on an exporter's error. */
static int
get_ints(PyObject *obj, Py_buffer *view, char kind, Py_ssize_t itemsize, int ndim)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FULL_RO) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    if (view->ndim != ndim || view->itemsize != itemsize || format_kind(view) != kind ||
        view->len < 0 || (view->len > 0 && view->buf == NULL) ||
        !PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* An exact int argument within lo .. hi (bool and other int subclasses refused). Returns 1
 * with *out set, 0 when it does not qualify (no exception), -1 on error. */
static int
exact_int(PyObject *obj, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *out)
{
    int overflow;
    long long v;
    if (!PyLong_CheckExact(obj)) {
        return 0;
    }
    v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || v < lo || v > hi) {
        return 0;
    }
    *out = (Py_ssize_t)v;
    return 1;
}

/* num_sampled[i], int32 or int64 (size 4 or 8) */
static inline long long
load_count(const char *p, Py_ssize_t size, Py_ssize_t i)
{
    if (size == 8) {
        int64_t v;
        memcpy(&v, p + i * 8, 8);
        return (long long)v;
    }
    return (long long)load_i32(p, i);
}

#define MASK_SLACK 8 /* spare ids past the end of the ids buffer, for bits_to_ids */

static inline void
store_i64(char *p, Py_ssize_t i, int64_t v)
{
    memcpy(p + i * 8, &v, 8);
}

/* One SamplingMaskTensors' host fields, shapes checked: rows of `width` compact ids, of
 * `row_bytes` bitmask bytes, and the counts. */
typedef struct {
    const char *tok;
    const unsigned char *bits;
    const char *counts;
    Py_ssize_t width, row_bytes, vocab;
} MaskRows;

/* Writes kept row r's support to dst, which takes `left` ids (plus MASK_SLACK spare ones),
 * and returns its count; -1 when the count is negative or past `left`, or (a wide row) its
 * bitmask row does not hold exactly that many ids. */
static AO_ALWAYS_INLINE Py_ssize_t
mask_row(const MaskRows *m, Py_ssize_t r, char *dst, Py_ssize_t left)
{
    Py_ssize_t n = load_i32(m->counts, r);
    if (n < 0 || n > left) {
        return -1;
    }
    if (n <= m->width) {
        if (n > 0) { /* memcpy of 0 bytes may still not be given NULL */
            memcpy(dst, m->tok + r * m->width * 4, (size_t)n * 4);
        }
        return n;
    }
    return bits_to_ids(m->bits + r * m->row_bytes, m->vocab, dst, n, left + MASK_SLACK) == n ? n
                                                                                           : -1;
}

/* mask_supports(token_ids, packed_mask, counts, vocab_size, rows_per_request, num_sampled)
 *     -> (ids, offsets, cu) | None
 *
 * The whole host side of SamplingMaskTensors: which rows are kept, their supports and the
 * offsets, from the three fields as host buffers (numpy arrays):
 *   token_ids int32 [rows, width], packed_mask uint8 [rows, ceil(vocab_size / 8)],
 *   counts int32 [rows], rows = num_reqs * rows_per_request; num_sampled None or int32/int64
 *   [num_reqs], each within 0 .. rows_per_request when rows_per_request > 1 (None only when
 *   it is 1).
 * Slot s of request q (row q * rows_per_request + s) is kept when rows_per_request is 1 or
 * s < num_sampled[q]. A kept row with count <= width gives its first `count` compact ids as
 * they are; a wider one the set bits of its bitmask row below vocab_size, which must number
 * exactly `count`.
 * Returns bytearrays: ids (int32, every kept row's support in order), offsets (int64, one
 * per kept row plus the leading 0) and, when rows_per_request > 1, cu (int32, the running sum
 * of num_sampled from 0), else None. None for anything else: a buffer of another type, rank,
 * shape or layout, a non-int or out-of-range argument, a negative or impossible count, a
 * bitmask row that disagrees with its count. The caller's numpy path then raises the
 * precise error. Every count is checked before it is used, so no input reads or writes out
 * of bounds. */
static PyObject *
mask_supports(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer tbuf, pbuf, cbuf, nbuf;
    int have_t = 0, have_p = 0, have_c = 0, have_n = 0, got;
    Py_ssize_t vocab = 0, rpr = 0, ns_size = 0;
    PyObject *ids = NULL, *offsets = NULL, *cu = NULL, *result = NULL;

    if (!check_nargs("mask_supports", nargs, 6)) {
        return NULL;
    }
    /* Ids are int32: a vocabulary of at most 2**31 ids. */
    if ((got = exact_int(args[3], 0, (Py_ssize_t)INT32_MAX + 1, &vocab)) <= 0 ||
        (got = exact_int(args[4], 1, PY_SSIZE_T_MAX, &rpr)) <= 0) {
        return got < 0 ? NULL : Py_NewRef(Py_None);
    }
    if ((have_t = get_ints(args[0], &tbuf, 'i', 4, 2)) < 0 ||
        (have_p = get_ints(args[1], &pbuf, 'u', 1, 2)) < 0 ||
        (have_c = get_ints(args[2], &cbuf, 'i', 4, 1)) < 0) {
        goto done;
    }
    if (!have_t || !have_p || !have_c) {
        goto none;
    }
    if (args[5] == Py_None) {
        if (rpr != 1) {
            goto none;
        }
    }
    else {
        if ((have_n = get_ints(args[5], &nbuf, 'i', 8, 1)) < 0) {
            goto done;
        }
        if (have_n == 0 && (have_n = get_ints(args[5], &nbuf, 'i', 4, 1)) < 0) {
            goto done;
        }
        if (!have_n) {
            goto none;
        }
        ns_size = nbuf.itemsize;
    }
    {
        Py_ssize_t rows = cbuf.shape[0], row_bytes = (vocab + 7) / 8;
        Py_ssize_t num_reqs, num_pos = 0, total = 0, at = 0, pos = 0, most;
        const char *counts = (const char *)cbuf.buf;
        const char *ns = have_n ? (const char *)nbuf.buf : NULL;
        MaskRows m = {(const char *)tbuf.buf, (const unsigned char *)pbuf.buf, counts,
                      tbuf.shape[1], row_bytes, vocab};
        char *ip, *op, *cp = NULL;

        if (tbuf.shape[0] != rows || pbuf.shape[0] != rows || pbuf.shape[1] != row_bytes ||
            rows % rpr) {
            goto none;
        }
        num_reqs = rows / rpr;
        if (ns != NULL && nbuf.shape[0] != num_reqs) {
            goto none;
        }
        /* Only rows_per_request > 1 reads num_sampled (with 1, vLLM keeps every row). */
        if (rpr == 1) {
            ns = NULL;
        }
        /* A kept row holds at most max(width, vocab) ids: bounds every count, so the total
         * (<= rows * most, and tok or packed holds that many bytes) cannot overflow. */
        most = m.width > vocab ? m.width : vocab;
        /* Sizes first: kept rows, and the total of their counts. */
        if (ns == NULL) {
            for (Py_ssize_t r = 0; r < rows; r++) {
                Py_ssize_t n = load_i32(counts, r);
                if (n < 0 || n > most) {
                    goto none;
                }
                total += n;
            }
            num_pos = rows;
        }
        else {
            for (Py_ssize_t q = 0; q < num_reqs; q++) {
                long long k = load_count(ns, ns_size, q);
                if (k < 0 || k > rpr) {
                    goto none;
                }
                for (Py_ssize_t r = q * rpr, end = r + (Py_ssize_t)k; r < end; r++) {
                    Py_ssize_t n = load_i32(counts, r);
                    if (n < 0 || n > most) {
                        goto none;
                    }
                    total += n;
                }
                num_pos += (Py_ssize_t)k;
            }
        }
        if (num_pos > OFFSET_MAX || total > (PY_SSIZE_T_MAX / 4) - MASK_SLACK) {
            goto none;
        }
        ids = PyByteArray_FromStringAndSize(NULL, (total + MASK_SLACK) * 4);
        offsets = PyByteArray_FromStringAndSize(NULL, (num_pos + 1) * 8);
        if (ids == NULL || offsets == NULL) {
            goto done;
        }
        if (ns != NULL) {
            if ((cu = PyByteArray_FromStringAndSize(NULL, (num_reqs + 1) * 4)) == NULL) {
                goto done;
            }
            cp = PyByteArray_AS_STRING(cu);
            store_i32(cp, 0, 0);
        }
        ip = PyByteArray_AS_STRING(ids);
        op = PyByteArray_AS_STRING(offsets);
        store_i64(op, 0, 0);
        /* Then the fill, which re-checks every count it relies on (mask_row, and k against
         * num_pos): the caller's buffers are not ours, and another thread may write them. */
        if (ns == NULL) {
            for (Py_ssize_t r = 0; r < rows; r++) {
                Py_ssize_t n = mask_row(&m, r, ip + at * 4, total - at);
                if (n < 0) {
                    goto none;
                }
                at += n;
                store_i64(op, r + 1, (int64_t)at);
            }
            pos = rows;
        }
        else {
            for (Py_ssize_t q = 0; q < num_reqs; q++) {
                long long k = load_count(ns, ns_size, q);
                if (k < 0 || k > rpr || k > num_pos - pos) {
                    goto none;
                }
                for (Py_ssize_t s = 0; s < (Py_ssize_t)k; s++) {
                    Py_ssize_t n = mask_row(&m, q * rpr + s, ip + at * 4, total - at);
                    if (n < 0) {
                        goto none;
                    }
                    at += n;
                    store_i64(op, pos + 1 + s, (int64_t)at);
                }
                pos += (Py_ssize_t)k;
                store_i32(cp, q + 1, (int32_t)pos);
            }
        }
        if (at != total || pos != num_pos) {
            goto none;
        }
        if (PyByteArray_Resize(ids, total * 4) < 0) {
            goto done;
        }
    }
    result = PyTuple_Pack(3, ids, offsets, cu == NULL ? Py_None : cu);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(ids);
    Py_XDECREF(offsets);
    Py_XDECREF(cu);
    if (have_t > 0) PyBuffer_Release(&tbuf);
    if (have_p > 0) PyBuffer_Release(&pbuf);
    if (have_c > 0) PyBuffer_Release(&cbuf);
    if (have_n > 0) PyBuffer_Release(&nbuf);
    return result;
}

/* message_custom_metadata(meta) -> list | None
 *
 * The custom_metadata (key, value) pairs of an Arrow IPC Message flatbuffer (the bytes of
 * pyarrow.ipc.Message.metadata, from a shared-memory slot: untrusted), as
 * _pyspeedups.custom_metadata_pairs reads them. Every read is bounds-checked; positions are
 * int64 sums of at most four 32-bit fields, so they never overflow. None when meta is no
 * buffer or anything is out of bounds (the caller asks the specification what). */
static int
fb_u16(const uint8_t *b, int64_t size, int64_t pos, int64_t *out)
{
    if (pos < 0 || pos + 2 > size) {
        return 0;
    }
    *out = (int64_t)b[pos] | ((int64_t)b[pos + 1] << 8);
    return 1;
}

static int
fb_u32(const uint8_t *b, int64_t size, int64_t pos, int64_t *out)
{
    uint32_t v;
    if (pos < 0 || pos + 4 > size) {
        return 0;
    }
    v = (uint32_t)b[pos] | ((uint32_t)b[pos + 1] << 8) | ((uint32_t)b[pos + 2] << 16) |
        ((uint32_t)b[pos + 3] << 24);
    *out = (int64_t)v;
    return 1;
}

static int
fb_i32(const uint8_t *b, int64_t size, int64_t pos, int64_t *out)
{
    int64_t u;
    if (!fb_u32(b, size, pos, &u)) {
        return 0;
    }
    *out = u >= ((int64_t)1 << 31) ? u - ((int64_t)1 << 32) : u;
    return 1;
}

/* The table's field `slot` offset (0 when the vtable is too short to hold it): 1, or 0 when
 * a read is out of bounds. */
static int
fb_field(const uint8_t *b, int64_t size, int64_t vtable, int64_t vsize, int64_t slot,
         int64_t *off)
{
    if (slot + 2 > vsize) {
        *off = 0;
        return 1;
    }
    return fb_u16(b, size, vtable + slot, off);
}

/* The vtable of the table at `table` and its size: 1, or 0 when out of bounds. */
static int
fb_vtable(const uint8_t *b, int64_t size, int64_t table, int64_t *vtable, int64_t *vsize)
{
    int64_t rel;
    if (!fb_i32(b, size, table, &rel)) {
        return 0;
    }
    *vtable = table - rel;
    return *vtable >= 0 && fb_u16(b, size, *vtable, vsize);
}

/* The string a table's field points to (field offset `off`, non-zero), as new bytes; NULL
 * with no exception when out of bounds, NULL with one on error. */
static PyObject *
fb_string(const uint8_t *b, int64_t size, int64_t table, int64_t off)
{
    int64_t at = table + off, rel, n;
    if (!fb_u32(b, size, at, &rel) || !fb_u32(b, size, at + rel, &n) ||
        n > size - (at + rel + 4)) {
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)b + at + rel + 4, (Py_ssize_t)n);
}

static PyObject *
message_custom_metadata(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    const uint8_t *b;
    int64_t size, table, vtable, vsize, off, vec, count;
    PyObject *out = NULL;
    int have;

    if (!check_nargs("message_custom_metadata", nargs, 1)) {
        return NULL;
    }
    if ((have = get_bytes(args[0], &view)) <= 0) {
        return have < 0 ? NULL : Py_NewRef(Py_None);
    }
    b = view.buf;
    size = (int64_t)view.len;
    if (!fb_u32(b, size, 0, &table) || !fb_vtable(b, size, table, &vtable, &vsize) ||
        !fb_field(b, size, vtable, vsize, 4 + 2 * 4, &off)) {
        goto none;
    }
    if (off == 0) {
        out = PyList_New(0);
        goto done;
    }
    if (!fb_u32(b, size, table + off, &vec)) {
        goto none;
    }
    vec += table + off;
    if (!fb_u32(b, size, vec, &count) || count > (size - vec - 4) / 4) {
        goto none;
    }
    out = PyList_New((Py_ssize_t)count);
    if (out == NULL) {
        goto done;
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t item = vec + 4 + 4 * i, rel, kv, key_off, value_off;
        PyObject *key, *value, *pair;
        if (!fb_u32(b, size, item, &rel)) {
            goto none;
        }
        kv = item + rel;
        if (!fb_vtable(b, size, kv, &vtable, &vsize) ||
            !fb_field(b, size, vtable, vsize, 4, &key_off) || key_off == 0) {
            goto none;
        }
        key = fb_string(b, size, kv, key_off);
        if (key == NULL) {
            goto fail_or_none;
        }
        if (!fb_field(b, size, vtable, vsize, 6, &value_off) || value_off == 0) {
            Py_DECREF(key);
            goto none;
        }
        value = fb_string(b, size, kv, value_off);
        if (value == NULL) {
            Py_DECREF(key);
            goto fail_or_none;
        }
        pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(key);
            Py_DECREF(value);
            goto fail;
        }
        PyTuple_SET_ITEM(pair, 0, key);
        PyTuple_SET_ITEM(pair, 1, value);
        PyList_SET_ITEM(out, (Py_ssize_t)i, pair);
    }
    goto done;
fail_or_none:
    if (!PyErr_Occurred()) {
        goto none;
    }
fail:
    Py_CLEAR(out);
    goto done;
none:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return out;
}

/* sampled_rows(padded, counts) -> (values, offsets, k) | None
 *
 * The sampled-ids column's buffers from a step's staged host copies, as vLLM's
 * `del row[count:]` trims each row: padded int64 [rows, width] (C-contiguous; slots past a
 * row's count are never read) and counts int32 [rows]. Row r keeps its first
 * min(counts[r], width) slots. Returns values (bytearray, int64: every kept slot in row
 * order), and either offsets None with k, when every row keeps the same k slots (a decode
 * step: the caller's cached offsets [0, k, 2k, ...] apply), or offsets (bytearray, int32,
 * rows + 1) with k = -1. None for anything else: another type, rank or layout, no rows,
 * a count below 0, more than 2**31 - 1 kept slots. The caller's numpy path then raises the
 * precise error. */
static PyObject *
sampled_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer pbuf, cbuf;
    int have_p = 0, have_c = 0;
    PyObject *values = NULL, *offsets = NULL, *result = NULL;

    if (!check_nargs("sampled_rows", nargs, 2)) {
        return NULL;
    }
    if ((have_p = get_ints(args[0], &pbuf, 'i', 8, 2)) < 0 ||
        (have_p && (have_c = get_ints(args[1], &cbuf, 'i', 4, 1)) < 0)) {
        goto done;
    }
    if (!have_p || !have_c) {
        goto none;
    }
    {
        Py_ssize_t rows = pbuf.shape[0], width = pbuf.shape[1], total = 0, k = -1;
        const char *src = (const char *)pbuf.buf, *counts = (const char *)cbuf.buf;
        char *out;
        int uniform = 1;

        if (rows < 1 || cbuf.shape[0] != rows) {
            goto none;
        }
        /* Sizes first: total <= rows * width, which the buffer holds, so no overflow. */
        for (Py_ssize_t r = 0; r < rows; r++) {
            Py_ssize_t c = load_i32(counts, r);
            if (c < 0) {
                goto none;
            }
            c = c < width ? c : width;
            if (r == 0) {
                k = c;
            }
            else if (c != k) {
                uniform = 0;
            }
            total += c;
        }
        if (total > INT32_MAX) {
            goto none;
        }
        values = PyByteArray_FromStringAndSize(NULL, total * 8);
        if (values == NULL) {
            goto done;
        }
        out = PyByteArray_AS_STRING(values);
        if (uniform) {
            if (k == width) {
                if (total > 0) { /* memcpy of 0 bytes may still not be given NULL */
                    memcpy(out, src, (size_t)total * 8);
                }
            }
            else {
                for (Py_ssize_t r = 0; r < rows; r++) {
                    memcpy(out + r * k * 8, src + r * width * 8, (size_t)k * 8);
                }
            }
        }
        else {
            /* The fill re-reads each count (another thread may write the caller's buffer)
             * and stops at the total sized above. */
            Py_ssize_t at = 0;
            char *op;
            offsets = PyByteArray_FromStringAndSize(NULL, (rows + 1) * 4);
            if (offsets == NULL) {
                goto done;
            }
            op = PyByteArray_AS_STRING(offsets);
            store_i32(op, 0, 0);
            for (Py_ssize_t r = 0; r < rows; r++) {
                Py_ssize_t c = load_i32(counts, r);
                c = c < 0 ? 0 : (c < width ? c : width);
                if (c > total - at) {
                    goto none;
                }
                if (c > 0) {
                    memcpy(out + at * 8, src + r * width * 8, (size_t)c * 8);
                }
                at += c;
                store_i32(op, r + 1, (int32_t)at);
            }
            if (at != total) {
                goto none;
            }
            k = -1;
        }
        result = Py_BuildValue("(OOn)", values, offsets == NULL ? Py_None : offsets, k);
    }
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(values);
    Py_XDECREF(offsets);
    if (have_p > 0) PyBuffer_Release(&pbuf);
    if (have_c > 0) PyBuffer_Release(&cbuf);
    return result;
}

/* int32_head(values, n) -> bytearray | None
 *
 * A copy of the first n items of a 1-D C-contiguous int32 buffer (a step's staged NaN counts,
 * one per request). None when it is not one, n is not an exact int >= 0, or the buffer holds
 * fewer than n items: the caller's numpy path then does the rest. */
static PyObject *
int32_head(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    int have, got;
    Py_ssize_t n = 0;
    PyObject *result = NULL;

    if (!check_nargs("int32_head", nargs, 2)) {
        return NULL;
    }
    if ((got = exact_int(args[1], 0, PY_SSIZE_T_MAX / 4, &n)) <= 0) {
        return got < 0 ? NULL : Py_NewRef(Py_None);
    }
    if ((have = get_ints(args[0], &view, 'i', 4, 1)) <= 0) {
        return have < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (view.shape[0] < n) {
        result = Py_NewRef(Py_None);
    }
    else {
        result = PyByteArray_FromStringAndSize(n > 0 ? (const char *)view.buf : NULL, n * 4);
    }
    PyBuffer_Release(&view);
    return result;
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

/* offsets_ok(values, last) -> bool
 *
 * Whether values are valid Arrow offsets of `last` items as a producer hands them over: a
 * 1-D C-contiguous buffer of native signed int64 (or int32) holding at least one item,
 * starting at 0, never decreasing and ending at `last` (an exact int). False for anything
 * else: the caller's numpy checks then name what is wrong. */
static PyObject *
offsets_ok(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer view;
    int have, overflow, ok = 0;
    long long last;

    if (!check_nargs("offsets_ok", nargs, 2)) {
        return NULL;
    }
    if (!PyLong_CheckExact(args[1])) {
        Py_RETURN_FALSE;
    }
    last = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (last == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow) {
        Py_RETURN_FALSE;
    }
    if ((have = get_ints(args[0], &view, 'i', 8, 1)) == 0) {
        have = get_ints(args[0], &view, 'i', 4, 1);
    }
    if (have <= 0) {
        return have < 0 ? NULL : Py_NewRef(Py_False);
    }
    if (view.shape[0] > 0) {
        const char *p = (const char *)view.buf;
        long long prev = load_count(p, view.itemsize, 0);
        ok = prev == 0;
        for (Py_ssize_t i = 1; ok && i < view.shape[0]; i++) {
            long long cur = load_count(p, view.itemsize, i);
            ok = cur >= prev;
            prev = cur;
        }
        ok = ok && prev == last;
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
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

/* (capsule, address of ptr): the pair build_array and array_slot return. Takes the caller's
 * reference to `capsule`, whose destructor frees what ptr points to on every path. */
static PyObject *
capsule_and_address(PyObject *capsule, void *ptr)
{
    PyObject *address, *result;
    address = PyLong_FromVoidPtr(ptr);
    if (address == NULL) {
        Py_DECREF(capsule);
        return NULL;
    }
    result = PyTuple_Pack(2, capsule, address);
    Py_DECREF(capsule);
    Py_DECREF(address);
    return result;
}

static PyObject *
build_array(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    TreeSize sz = {0, 0, 0, 0};
    TreeFill f;
    size_t bytes;
    char *mem;
    PyObject *capsule;

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
    return capsule_and_address(capsule, &f.arrays[0]);
}

/* ------------------------------------------------------------------ decode: one export
 *
 * array_slot() -> (capsule, address)
 * decode_batch(capsule, n, columns, step, absent, sampled, logprobs, mask, known)
 *     -> tuple | None
 *
 * The decode side's walk over a whole record batch. The caller exports the batch once
 * (RecordBatch._export_to_c(address): no schema) into the ArrowArray that array_slot
 * allocated, after pyarrow's validate() (buffer sizes against lengths, first and last
 * offsets against what they index: the interface carries no buffer sizes) or
 * validate(full=True). decode_batch then reads the tree and builds the decoded output's
 * Python objects: request ids, the id -> row dict, the sampled token id lists, the
 * cu_num_generated_tokens lists, and read-only "regions" (buffer-protocol views of parts of
 * the exported buffers that hold the capsule, so the batch's memory lives as long as the
 * numpy arrays made over them: zero-copy).
 *
 * Like the walks above it does the whole job or returns None: any node not of the expected
 * shape (buffer and child counts, a non-zero offset, a null count that is not the one the
 * step's layout needs), any offset out of order or out of bounds, a step or req_index value
 * that is not the expected one, a request id that is not UTF-8, a duplicate request id, a
 * logprob matrix that is not rectangular or not of the layout's width. The caller's
 * pure-Python decode then runs and raises the precise error (or decodes the rare shapes
 * left to it: slices, empty steps). Every offset is checked against the length of what it
 * indexes before anything is read through it.
 *
 * columns = (step, req_id, req_index, sampled_token_ids, logprobs, sampling_mask) positions;
 * step = None or the int64 step; absent = positions of columns that must be all null;
 * sampled = 0 (a pooling step: all null) or the id itemsize 4/8; logprobs = None (absent)
 * or (id itemsize, rank itemsize, cu as list: bool, width or -1); mask = None (absent) or
 * (cu as list: bool).
 * known = the last result's entry of request ids, or None (see known_matches).
 * Result: (req_ids, req_id_to_index, sampled, lp, mask, known) with lp = None or
 * (ids region, logprobs region, ranks region, positions, width, cu list or None) and
 * mask = None or (token_ids region, offsets region, cu list or None). */

#define DEC_MAX_COLUMNS 64

typedef struct {
    PyObject_HEAD
    PyObject *owner; /* the capsule holding the exported ArrowArray */
    const char *buf;
    Py_ssize_t len;
} RegionObject;

static void
region_dealloc(RegionObject *self)
{
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
region_getbuffer(RegionObject *self, Py_buffer *view, int flags)
{
    /* Read-only: Arrow's buffers are immutable, and IPC's are mapped file pages. */
    return PyBuffer_FillInfo(view, (PyObject *)self, (void *)self->buf, self->len, 1, flags);
}

static PyBufferProcs region_as_buffer = {
    .bf_getbuffer = (getbufferproc)region_getbuffer,
    .bf_releasebuffer = NULL,
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "arrow_outputs._speedups.Region",
    .tp_basicsize = sizeof(RegionObject),
    .tp_dealloc = (destructor)region_dealloc,
    .tp_as_buffer = &region_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read-only bytes of an exported record batch's buffer (decode_batch).",
};

static PyObject *
region_new(PyObject *owner, const char *buf, Py_ssize_t len)
{
    RegionObject *r = PyObject_New(RegionObject, &RegionType);
    if (r == NULL) {
        return NULL;
    }
    r->owner = Py_NewRef(owner);
    r->buf = buf;
    r->len = len;
    return (PyObject *)r;
}

#define SLOT_CAPSULE "arrow_outputs._speedups.exported"

static void
slot_destroy(PyObject *capsule)
{
    struct ArrowArray *a = PyCapsule_GetPointer(capsule, SLOT_CAPSULE);
    if (a == NULL) {
        PyErr_Clear();
        return;
    }
    if (a->release != NULL) {
        a->release(a);
    }
    PyMem_Free(a);
}

/* array_slot() -> (capsule, address): an empty ArrowArray (release NULL) to export into;
 * the capsule releases whatever was exported there when it goes. */
static PyObject *
array_slot(PyObject *Py_UNUSED(module), PyObject *const *Py_UNUSED(args), Py_ssize_t nargs)
{
    struct ArrowArray *a;
    PyObject *capsule;

    if (!check_nargs("array_slot", nargs, 0)) {
        return NULL;
    }
    a = PyMem_Calloc(1, sizeof(struct ArrowArray));
    if (a == NULL) {
        return PyErr_NoMemory();
    }
    capsule = PyCapsule_New(a, SLOT_CAPSULE, slot_destroy);
    if (capsule == NULL) {
        PyMem_Free(a);
        return NULL;
    }
    return capsule_and_address(capsule, a);
}

/* A node of the expected shape: not released, no dictionary, offset 0, the buffer and child
 * counts of its layout, its pointer arrays present, every child present. */
static int
dec_node(const struct ArrowArray *a, int64_t n_buffers, int64_t n_children)
{
    if (a == NULL || a->release == NULL || a->dictionary != NULL || a->offset != 0 ||
        a->length < 0 || a->length > PY_SSIZE_T_MAX / 8 || a->n_buffers != n_buffers ||
        a->n_children != n_children || (n_buffers > 0 && a->buffers == NULL) ||
        (n_children > 0 && a->children == NULL)) {
        return 0;
    }
    for (int64_t i = 0; i < n_children; i++) {
        if (a->children[i] == NULL) {
            return 0;
        }
    }
    return 1;
}

/* The node's null count; an unknown one (-1) counted from its validity bitmap (validate()
 * proved the bitmap long enough). -1 when it cannot be known. */
static int64_t
dec_nulls(const struct ArrowArray *a)
{
    int64_t valid = 0;
    const uint8_t *bits;

    if (a->null_count >= 0) {
        return a->null_count <= a->length ? a->null_count : -1;
    }
    if (a->null_count != -1 || a->n_buffers < 1 || a->buffers == NULL) {
        return -1;
    }
    bits = a->buffers[0];
    if (bits == NULL) {
        return 0;
    }
    for (int64_t i = 0; i < a->length; i++) {
        valid += (bits[i >> 3] >> (i & 7)) & 1;
    }
    return a->length - valid;
}

/* A node with no nulls and the given shape. */
static int
dec_dense(const struct ArrowArray *a, int64_t n_buffers, int64_t n_children)
{
    return dec_node(a, n_buffers, n_children) && dec_nulls(a) == 0;
}

/* A primitive node (validity, values) of at least `need` values, none null, its values
 * buffer present when need > 0. */
static const char *
dec_values(const struct ArrowArray *a, int64_t need)
{
    if (!dec_dense(a, 2, 0) || a->length < need) {
        return NULL;
    }
    if (a->buffers[1] == NULL) {
        return need == 0 ? "" : NULL;
    }
    return a->buffers[1];
}

/* int32 offsets[from .. to] of a list-like node: first >= 0, non-decreasing, last <= limit. */
static int
dec_offsets32(const char *offs, int64_t from, int64_t to, int64_t limit)
{
    int32_t prev;
    if (offs == NULL) {
        return 0;
    }
    prev = load_i32(offs, from);
    if (prev < 0) {
        return 0;
    }
    for (int64_t i = from + 1; i <= to; i++) {
        int32_t cur = load_i32(offs, i);
        if (cur < prev) {
            return 0;
        }
        prev = cur;
    }
    return prev <= limit;
}

/* Python ints offs[from + i] - base for i in 0..count (int32 offsets). */
static PyObject *
dec_cu_list(const char *offs, int64_t from, int64_t count)
{
    int32_t base = load_i32(offs, from);
    PyObject *list = PyList_New((Py_ssize_t)count + 1);
    if (list == NULL) {
        return NULL;
    }
    for (int64_t i = 0; i <= count; i++) {
        PyObject *v = PyLong_FromLong((long)load_i32(offs, from + i) - (long)base);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

/* Whether offs[from + i] - offs[from] == i * step for i in 0..count. */
static int
dec_arange32(const char *offs, int64_t from, int64_t count, int64_t step)
{
    int64_t base = load_i32(offs, from);
    for (int64_t i = 1; i <= count; i++) {
        if ((int64_t)load_i32(offs, from + i) - base != i * step) {
            return 0;
        }
    }
    return 1;
}

/* A list column of n rows without nulls (validity, offsets; one child) whose child is a
 * node of nbuf buffers and nchild children without nulls, and whose n + 1 offsets index
 * within the child: 1 with *child and *outer set, 0 otherwise. */
static int
dec_list_of(const struct ArrowArray *col, int64_t n, int64_t nbuf, int64_t nchild,
            const struct ArrowArray **child, const char **outer)
{
    if (!dec_dense(col, 2, 1) || col->length != n) {
        return 0;
    }
    *child = col->children[0];
    *outer = col->buffers[1];
    return dec_dense(*child, nbuf, nchild) && dec_offsets32(*outer, 0, n, (*child)->length);
}

/* A list column's cu_num_generated_tokens from its n + 1 outer offsets: the offsets as a
 * Python list when the layout says a list was given (cu_list), else None after proving them
 * 0, 1, ..., n (one position per request). 1 with *cu set, 0 for "not this path", -1 on
 * error. */
static int
dec_outer_cu(const char *outer, int64_t n, int cu_list, PyObject **cu)
{
    if (cu_list) {
        *cu = dec_cu_list(outer, 0, n);
        return *cu == NULL ? -1 : 1;
    }
    if (!dec_arange32(outer, 0, n, 1)) {
        return 0;
    }
    *cu = Py_NewRef(Py_None);
    return 1;
}

static int
dec_flag(PyObject *obj)
{
    return obj == Py_True ? 1 : obj == Py_False ? 0 : -1;
}

/* A dict for n items: sized once where CPython offers it (3.8-3.12), instead of growing
 * through a rehash at every power of two. */
static PyObject *
new_dict(int64_t n)
{
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_NewPresized((Py_ssize_t)n);
#else
    (void)n;
    return PyDict_New();
#endif
}

/* Request ids seen in the last step decoded, kept for the next one: vLLM's decode steps keep
 * their requests, so most steps carry the very same req_id column. The entry is
 * (offsets bytes, data bytes, ids tuple, index dict), made here and never handed out: a step
 * whose offsets and UTF-8 bytes are equal byte for byte gets a new list of the same str
 * objects (immutable) and a copy of the dict, instead of decoding n strings and hashing
 * them again; any other step reuses the strs of the rows whose id is unchanged
 * (same_row_id). Small steps gain nothing and keep no entry. */
#define KNOWN_MIN_ROWS 32
#define KNOWN_MAX_BYTES (1 << 20)

/* The known entry's ids tuple (borrowed), or NULL when the entry is not one. */
static PyObject *
known_row_ids(PyObject *known)
{
    PyObject *kids;
    if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 4) {
        return NULL;
    }
    kids = PyTuple_GET_ITEM(known, 2);
    return PyTuple_CheckExact(kids) ? kids : NULL;
}

static int
known_matches(PyObject *known, const char *offs, const char *data, int64_t n, int32_t last)
{
    PyObject *ko, *kd, *kids = known_row_ids(known), *kindex;
    if (kids == NULL) {
        return 0;
    }
    ko = PyTuple_GET_ITEM(known, 0);
    kd = PyTuple_GET_ITEM(known, 1);
    kindex = PyTuple_GET_ITEM(known, 3);
    if (!PyBytes_CheckExact(ko) || !PyBytes_CheckExact(kd) || !PyDict_CheckExact(kindex) || PyBytes_GET_SIZE(ko) != (Py_ssize_t)((n + 1) * 4) ||
        PyBytes_GET_SIZE(kd) != (Py_ssize_t)last || PyTuple_GET_SIZE(kids) != (Py_ssize_t)n ||
        PyDict_GET_SIZE(kindex) != (Py_ssize_t)n) {
        return 0;
    }
    return memcmp(PyBytes_AS_STRING(ko), offs, (size_t)((n + 1) * 4)) == 0 &&
           (last == 0 || memcmp(PyBytes_AS_STRING(kd), data, (size_t)last) == 0);
}

/* The entry for the next step (see known_matches); NULL with an exception on error. */
static PyObject *
known_entry(const char *offs, const char *data, int64_t n, int32_t last, PyObject *ids,
            PyObject *index)
{
    PyObject *ko, *kd, *kids, *kindex;
    if (n < KNOWN_MIN_ROWS || last > KNOWN_MAX_BYTES) {
        return Py_NewRef(Py_None);
    }
    ko = PyBytes_FromStringAndSize(offs, (Py_ssize_t)((n + 1) * 4));
    kd = PyBytes_FromStringAndSize(last ? data : "", (Py_ssize_t)last);
    kids = PyList_AsTuple(ids);
    if (kids != NULL) {
        PyObject_GC_UnTrack(kids); /* never handed out; exact strs: no cycle */
    }
    kindex = PyDict_Copy(index);
    if (ko == NULL || kd == NULL || kids == NULL || kindex == NULL) {
        Py_XDECREF(ko);
        Py_XDECREF(kd);
        Py_XDECREF(kids);
        Py_XDECREF(kindex);
        return NULL;
    }
    return Py_BuildValue("(NNNN)", ko, kd, kids, kindex);
}

/* The known entry's ids as a new list, or NULL with no exception when an item is not an exact
 * str (an entry not made by known_entry: decoded afresh instead). */
static PyObject *
known_ids(PyObject *known, int64_t n)
{
    PyObject *kids = PyTuple_GET_ITEM(known, 2), *ids = PyList_New((Py_ssize_t)n);
    if (ids == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        PyObject *s = PyTuple_GET_ITEM(kids, i);
        if (!PyUnicode_CheckExact(s)) {
            Py_DECREF(ids);
            return NULL;
        }
        PyList_SET_ITEM(ids, i, Py_NewRef(s));
    }
    return ids;
}

/* A new reference to the last step's id at this row when it is this row's id (an exact ASCII
 * str of the very same bytes, compared here, so an entry can never put another id in), else
 * NULL (no exception): a step that keeps most of its requests in their rows, as vLLM's
 * persistent batch does while a few finish and join, decodes and hashes only the new ones. */
static PyObject *
same_row_id(PyObject *s, const char *bytes, int32_t len)
{
    if (PyUnicode_CheckExact(s) && PyUnicode_IS_COMPACT_ASCII(s) &&
        PyUnicode_GET_LENGTH(s) == (Py_ssize_t)len &&
        (len == 0 || memcmp(PyUnicode_DATA(s), bytes, (size_t)len) == 0)) {
        return Py_NewRef(s);
    }
    return NULL;
}

/* The ints 0..n-1 that req_id_to_index maps to, made once and shared by every step decoded
 * after (ints are immutable): a 1024-request decode otherwise makes and frees 1024 of them.
 * Steps of more than POSITIONS_MAX rows make their own. The module is for one interpreter
 * (speedups_slots), so one table serves it. */
#define POSITIONS_MAX (1 << 16)
static PyObject *positions; /* a tuple of ints 0, 1, ..., or NULL */

/* A borrowed tuple of at least n ints from 0; NULL without an exception when n is past
 * POSITIONS_MAX, NULL with one on error. */
static PyObject *
positions_for(int64_t n)
{
    PyObject *table;
    Py_ssize_t size;
    if (positions != NULL && PyTuple_GET_SIZE(positions) >= (Py_ssize_t)n) {
        return positions;
    }
    if (n > POSITIONS_MAX) {
        return NULL;
    }
    size = positions == NULL ? 256 : 2 * PyTuple_GET_SIZE(positions);
    while (size < (Py_ssize_t)n) {
        size *= 2;
    }
    if (size > POSITIONS_MAX) {
        size = POSITIONS_MAX;
    }
    table = PyTuple_New(size);
    if (table == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL) {
            Py_DECREF(table);
            return NULL;
        }
        PyTuple_SET_ITEM(table, i, v);
    }
    PyObject_GC_UnTrack(table); /* ints only */
    Py_XSETREF(positions, table);
    return table;
}

/* Returns 1 with *out set, 0 for "not this path" (no exception), -1 on error. *known_out is
 * the entry to pass with the next step (see known_matches). */
static int
dec_strs(const struct ArrowArray *col, int64_t n, PyObject *known, PyObject **ids_out,
         PyObject **index_out, PyObject **known_out)
{
    const char *offs, *data;
    PyObject *ids = NULL, *index = NULL, *kids, *table;
    Py_ssize_t kn;
    int32_t last;

    if (!dec_dense(col, 3, 0) || col->length != n) {
        return 0;
    }
    offs = col->buffers[1];
    data = col->buffers[2];
    /* validate() bounded the last offset by the data buffer's size. */
    if (!dec_offsets32(offs, 0, n, INT32_MAX)) {
        return 0;
    }
    last = load_i32(offs, n);
    if (last > 0 && data == NULL) {
        return 0;
    }
    if (load_i32(offs, 0) == 0 && known_matches(known, offs, data, n, last)) {
        ids = known_ids(known, n);
        if (ids != NULL) {
            index = PyDict_Copy(PyTuple_GET_ITEM(known, 3));
            if (index == NULL) {
                Py_DECREF(ids);
                return -1;
            }
            PyObject_GC_UnTrack(ids); /* exact strs only: see below */
            *ids_out = ids;
            *index_out = index;
            *known_out = Py_NewRef(known);
            return 1;
        }
        if (PyErr_Occurred()) {
            return -1;
        }
    }
    kids = known_row_ids(known);
    kn = kids == NULL ? 0 : PyTuple_GET_SIZE(kids);
    table = positions_for(n);
    if (table == NULL && PyErr_Occurred()) {
        return -1;
    }
    ids = PyList_New((Py_ssize_t)n);
    index = new_dict(n);
    if (ids == NULL || index == NULL) {
        goto error;
    }
    for (int64_t i = 0; i < n; i++) {
        int32_t a = load_i32(offs, i), b = load_i32(offs, i + 1);
        PyObject *s = i < kn ? same_row_id(PyTuple_GET_ITEM(kids, i), data + a, b - a) : NULL;
        PyObject *pos;
        int rc;
        if (s == NULL) {
            s = b > a ? PyUnicode_DecodeUTF8(data + a, (Py_ssize_t)b - a, "strict")
                      : PyUnicode_New(0, 0);
        }
        if (s == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                Py_DECREF(ids);
                Py_DECREF(index);
                return 0;
            }
            goto error;
        }
        PyList_SET_ITEM(ids, (Py_ssize_t)i, s);
        pos = table != NULL ? Py_NewRef(PyTuple_GET_ITEM(table, (Py_ssize_t)i))
                            : PyLong_FromLongLong((long long)i);
        if (pos == NULL) {
            goto error;
        }
        rc = PyDict_SetItem(index, s, pos); /* exact strs: no user __hash__ or __eq__ */
        Py_DECREF(pos);
        if (rc < 0) {
            goto error;
        }
    }
    if (PyDict_GET_SIZE(index) != (Py_ssize_t)n) { /* a duplicate id: the slow path says so */
        Py_DECREF(ids);
        Py_DECREF(index);
        return 0;
    }
    *known_out = load_i32(offs, 0) == 0 ? known_entry(offs, data, n, last, ids, index)
                                         : Py_NewRef(Py_None);
    if (*known_out == NULL) {
        goto error;
    }
    /* The ids list holds exact strs only, which make no reference cycle: it leaves the cycle
     * collector as the rows of ints do (see untrack_int_list), and so does the entry's tuple:
     * otherwise each collection a step sets off walks both, a third of its decode's share of
     * the collector at 1024 requests (docs/accelerator.md). */
    PyObject_GC_UnTrack(ids);
    *ids_out = ids;
    *index_out = index;
    return 1;
error:
    Py_XDECREF(ids);
    Py_XDECREF(index);
    return -1;
}

/* The sampled token id lists of a dense list<int32|int64> column. */
static int
dec_sampled(const struct ArrowArray *col, int64_t n, Py_ssize_t itemsize, PyObject **out)
{
    const struct ArrowArray *child;
    const char *offs, *vals;
    PyObject *outer;

    if (!dec_dense(col, 2, 1) || col->length != n) {
        return 0;
    }
    child = col->children[0];
    offs = col->buffers[1];
    if (!dec_node(child, 2, 0) || dec_nulls(child) != 0 ||
        !dec_offsets32(offs, 0, n, child->length)) {
        return 0;
    }
    vals = dec_values(child, load_i32(offs, n));
    if (vals == NULL) {
        return 0;
    }
    outer = PyList_New((Py_ssize_t)n);
    if (outer == NULL) {
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        Py_ssize_t a = load_i32(offs, i), b = load_i32(offs, i + 1);
        PyObject *inner = PyList_New(b - a);
        if (inner == NULL) {
            Py_DECREF(outer);
            return -1;
        }
        PyList_SET_ITEM(outer, (Py_ssize_t)i, inner);
        for (Py_ssize_t j = a; j < b; j++) {
            PyObject *v = int_at(vals, itemsize, j);
            if (v == NULL) {
                Py_DECREF(outer);
                return -1;
            }
            PyList_SET_ITEM(inner, j - a, v);
        }
        untrack_int_list(inner);
    }
    *out = outer;
    return 1;
}

/* A logprobs column: list<struct<token_ids: list<ID>, logprobs: list<float32>, rank: RANK>>. */
static int
dec_logprobs(PyObject *owner, const struct ArrowArray *col, int64_t n, PyObject *spec,
             PyObject **out)
{
    Py_ssize_t id_size, rank_size, width;
    int cu_list, rc;
    const struct ArrowArray *st, *tok, *lp, *rank, *tok_vals, *lp_vals;
    const char *outer, *tok_off, *lp_off, *ids, *lps, *ranks;
    int64_t p0, p1, num, w, lo, hi;
    PyObject *cu = NULL, *r_ids = NULL, *r_lps = NULL, *r_ranks = NULL;

    if (!PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) != 4 ||
        !ssize_arg(PyTuple_GET_ITEM(spec, 0), &id_size) ||
        !ssize_arg(PyTuple_GET_ITEM(spec, 1), &rank_size) ||
        !ssize_arg(PyTuple_GET_ITEM(spec, 3), &width)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "decode_batch: logprobs spec of 4 items");
        }
        return -1;
    }
    cu_list = dec_flag(PyTuple_GET_ITEM(spec, 2));
    if (cu_list < 0 || (id_size != 4 && id_size != 8) || (rank_size != 4 && rank_size != 8)) {
        PyErr_SetString(PyExc_ValueError, "decode_batch: bad logprobs spec");
        return -1;
    }
    if (!dec_list_of(col, n, 1, 3, &st, &outer)) {
        return 0;
    }
    p0 = load_i32(outer, 0);
    p1 = load_i32(outer, n);
    num = p1 - p0;
    tok = st->children[0];
    lp = st->children[1];
    rank = st->children[2];
    if (num <= 0 || !dec_dense(tok, 2, 1) || !dec_dense(lp, 2, 1) || tok->length < p1 ||
        lp->length < p1) {
        return 0;
    }
    tok_vals = tok->children[0];
    lp_vals = lp->children[0];
    tok_off = tok->buffers[1];
    lp_off = lp->buffers[1];
    ranks = dec_values(rank, p1);
    if (ranks == NULL || !dec_dense(tok_vals, 2, 0) || !dec_dense(lp_vals, 2, 0) ||
        tok_off == NULL || lp_off == NULL) {
        return 0;
    }
    if (!dec_offsets32(tok_off, p0, p1,
                       tok_vals->length < lp_vals->length ? tok_vals->length : lp_vals->length)) {
        return 0;
    }
    if (tok_off != lp_off) {
        for (int64_t i = p0; i <= p1; i++) {
            if (load_i32(tok_off, i) != load_i32(lp_off, i)) {
                return 0;
            }
        }
    }
    lo = load_i32(tok_off, p0);
    hi = load_i32(tok_off, p1);
    w = load_i32(tok_off, p0 + 1) - lo;
    if (w <= 0 || (width >= 0 && w != width) || !dec_arange32(tok_off, p0, num, w)) {
        return 0;
    }
    ids = dec_values(tok_vals, hi);
    lps = dec_values(lp_vals, hi);
    if (ids == NULL || lps == NULL) {
        return 0;
    }
    rc = dec_outer_cu(outer, n, cu_list, &cu);
    if (rc <= 0) {
        return rc;
    }
    r_ids = region_new(owner, ids + lo * id_size, (Py_ssize_t)((hi - lo) * id_size));
    r_lps = region_new(owner, lps + lo * 4, (Py_ssize_t)((hi - lo) * 4));
    r_ranks = region_new(owner, ranks + p0 * rank_size, (Py_ssize_t)(num * rank_size));
    if (r_ids == NULL || r_lps == NULL || r_ranks == NULL) {
        *out = NULL;
    }
    else {
        *out = Py_BuildValue("(OOOLLO)", r_ids, r_lps, r_ranks, (long long)num, (long long)w, cu);
    }
    Py_XDECREF(r_ids);
    Py_XDECREF(r_lps);
    Py_XDECREF(r_ranks);
    Py_DECREF(cu);
    return *out == NULL ? -1 : 1;
}

/* A sampling-mask column: list<large_list<int32>>, its CSR unsliced (first id offset 0). */
static int
dec_mask(PyObject *owner, const struct ArrowArray *col, int64_t n, PyObject *spec,
         PyObject **out)
{
    const struct ArrowArray *inner, *values;
    const char *outer, *csr, *ids;
    int64_t p0, p1, prev, hi;
    int cu_list, rc;
    PyObject *cu = NULL, *r_ids = NULL, *r_csr = NULL;

    if (!PyTuple_CheckExact(spec) || PyTuple_GET_SIZE(spec) != 1 ||
        (cu_list = dec_flag(PyTuple_GET_ITEM(spec, 0))) < 0) {
        PyErr_SetString(PyExc_TypeError, "decode_batch: mask spec (cu: bool,)");
        return -1;
    }
    if (!dec_list_of(col, n, 2, 1, &inner, &outer)) {
        return 0;
    }
    p0 = load_i32(outer, 0);
    p1 = load_i32(outer, n);
    values = inner->children[0];
    csr = inner->buffers[1];
    if (csr == NULL || !dec_dense(values, 2, 0)) {
        return 0;
    }
    /* int64 offsets csr[p0 .. p1]: start at 0 (an unsliced CSR), never decrease, end within
     * the values. */
    memcpy(&prev, csr + p0 * 8, 8);
    if (prev != 0) {
        return 0;
    }
    for (int64_t i = p0 + 1; i <= p1; i++) {
        int64_t cur;
        memcpy(&cur, csr + i * 8, 8);
        if (cur < prev) {
            return 0;
        }
        prev = cur;
    }
    hi = prev;
    if (hi > values->length) {
        return 0;
    }
    ids = dec_values(values, hi);
    if (ids == NULL || (hi > 0 && values->buffers[1] == NULL)) {
        return 0;
    }
    rc = dec_outer_cu(outer, n, cu_list, &cu);
    if (rc <= 0) {
        return rc;
    }
    r_ids = region_new(owner, ids, (Py_ssize_t)(hi * 4));
    r_csr = region_new(owner, csr + p0 * 8, (Py_ssize_t)((p1 - p0 + 1) * 8));
    if (r_ids == NULL || r_csr == NULL) {
        *out = NULL;
    }
    else {
        *out = PyTuple_Pack(3, r_ids, r_csr, cu);
    }
    Py_XDECREF(r_ids);
    Py_XDECREF(r_csr);
    Py_DECREF(cu);
    return *out == NULL ? -1 : 1;
}

static PyObject *
decode_batch(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *capsule, *columns, *step_obj, *absent, *lp_spec, *mask_spec, *known;
    PyObject *ids = NULL, *index = NULL, *sampled = NULL, *lp = NULL, *mask = NULL;
    PyObject *known_out = NULL;
    PyObject *result = NULL;
    Py_ssize_t n_arg, sampled_size, at[6];
    const struct ArrowArray *top, *col;
    long long step = 0;
    int64_t n;
    int rc;

    if (!check_nargs("decode_batch", nargs, 9) || !ssize_arg(args[1], &n_arg) ||
        !ssize_arg(args[5], &sampled_size)) {
        return NULL;
    }
    capsule = args[0];
    columns = args[2];
    step_obj = args[3];
    absent = args[4];
    lp_spec = args[6];
    mask_spec = args[7];
    known = args[8];
    if (!PyType_HasFeature(&RegionType, Py_TPFLAGS_READY) && PyType_Ready(&RegionType) < 0) {
        return NULL;
    }
    top = PyCapsule_GetPointer(capsule, SLOT_CAPSULE);
    if (top == NULL) {
        return NULL;
    }
    if (!PyTuple_CheckExact(columns) || PyTuple_GET_SIZE(columns) != 6 ||
        !PyTuple_CheckExact(absent) || (sampled_size != 0 && sampled_size != 4 &&
                                        sampled_size != 8)) {
        PyErr_SetString(PyExc_TypeError, "decode_batch: bad column plan");
        return NULL;
    }
    if (step_obj != Py_None) {
        int overflow = 0;
        if (!PyLong_CheckExact(step_obj)) {
            PyErr_SetString(PyExc_TypeError, "decode_batch: step must be an int or None");
            return NULL;
        }
        step = PyLong_AsLongLongAndOverflow(step_obj, &overflow);
        if ((step == -1 && PyErr_Occurred()) || overflow != 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_OverflowError, "decode_batch: step beyond int64");
            }
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < 6; i++) {
        if (!ssize_arg(PyTuple_GET_ITEM(columns, i), &at[i])) {
            return NULL;
        }
    }
    n = n_arg;
    /* The batch: a struct of its columns, exported (release set), of n >= 1 rows. */
    if (n < 1 || top->release == NULL || top->n_children < 1 ||
        top->n_children > DEC_MAX_COLUMNS || top->length != n || !dec_dense(top, 1, top->n_children)) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < 6; i++) {
        if (at[i] < 0 || at[i] >= top->n_children) {
            PyErr_SetString(PyExc_ValueError, "decode_batch: column position out of range");
            return NULL;
        }
    }
    for (int64_t i = 0; i < top->n_children; i++) {
        if (top->children[i]->length != n) {
            Py_RETURN_NONE;
        }
    }
    /* Absent columns: all null. */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(absent); i++) {
        Py_ssize_t k;
        if (!ssize_arg(PyTuple_GET_ITEM(absent, i), &k)) {
            return NULL;
        }
        if (k < 0 || k >= top->n_children) {
            PyErr_SetString(PyExc_ValueError, "decode_batch: absent position out of range");
            return NULL;
        }
        col = top->children[k];
        if (!dec_node(col, col->n_buffers, col->n_children) || col->n_buffers < 1 ||
            dec_nulls(col) != n) {
            Py_RETURN_NONE;
        }
    }
    /* step: n copies of the step number, or n nulls for None. */
    col = top->children[at[0]];
    if (step_obj == Py_None) {
        if (!dec_node(col, 2, 0) || dec_nulls(col) != n) {
            Py_RETURN_NONE;
        }
    }
    else {
        const char *v = dec_values(col, n);
        if (v == NULL) {
            Py_RETURN_NONE;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t x;
            memcpy(&x, v + i * 8, 8);
            if (x != (int64_t)step) {
                Py_RETURN_NONE;
            }
        }
    }
    /* req_index: 0 .. n-1, the whole step in order. */
    {
        const char *v = dec_values(top->children[at[2]], n);
        if (v == NULL) {
            Py_RETURN_NONE;
        }
        for (int64_t i = 0; i < n; i++) {
            if (load_i32(v, i) != i) {
                Py_RETURN_NONE;
            }
        }
    }
    rc = dec_strs(top->children[at[1]], n, known, &ids, &index, &known_out);
    if (rc <= 0) {
        goto out;
    }
    if (sampled_size == 0) {
        col = top->children[at[3]];
        if (!dec_node(col, 2, 1) || dec_nulls(col) != n) {
            rc = 0;
            goto out;
        }
        sampled = PyList_New(0);
        rc = sampled == NULL ? -1 : 1;
    }
    else {
        rc = dec_sampled(top->children[at[3]], n, sampled_size, &sampled);
    }
    if (rc <= 0) {
        goto out;
    }
    if (lp_spec == Py_None) {
        lp = Py_NewRef(Py_None);
    }
    else if ((rc = dec_logprobs(capsule, top->children[at[4]], n, lp_spec, &lp)) <= 0) {
        goto out;
    }
    if (mask_spec == Py_None) {
        mask = Py_NewRef(Py_None);
    }
    else if ((rc = dec_mask(capsule, top->children[at[5]], n, mask_spec, &mask)) <= 0) {
        goto out;
    }
    result = PyTuple_Pack(6, ids, index, sampled, lp, mask, known_out);
out:
    Py_XDECREF(known_out);
    Py_XDECREF(ids);
    Py_XDECREF(index);
    Py_XDECREF(sampled);
    Py_XDECREF(lp);
    Py_XDECREF(mask);
    if (result == NULL && rc == 0 && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
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
    {"copy_from_address", (PyCFunction)(void (*)(void))copy_from_address, METH_FASTCALL,
     "copy_from_address(dst, offset, address, nbytes, /)\n--\n\n"
     "Copy nbytes from a raw host address into a writable buffer (see _pyspeedups)."},
    {"str_list", (PyCFunction)(void (*)(void))str_list, METH_FASTCALL,
     "str_list(offsets, data, offset, n, /)\n--\n\n"
     "The strs of an Arrow string array's buffers, or None (see _pyspeedups)."},
    {"split_int_lists", (PyCFunction)(void (*)(void))split_int_lists, METH_FASTCALL,
     "split_int_lists(values, offsets, itemsize, n, /)\n--\n\n"
     "The lists of ints of an Arrow list array's buffers, or None (see _pyspeedups)."},
    {"mask_rows", (PyCFunction)(void (*)(void))mask_rows, METH_FASTCALL,
     "Sampling-mask rows' supports into an int32 buffer (see _pyspeedups.mask_rows)."},
    {"mask_supports", (PyCFunction)(void (*)(void))mask_supports, METH_FASTCALL,
     "mask_supports(token_ids, packed_mask, counts, vocab_size, rows_per_request, "
     "num_sampled, /)\n--\n\n"
     "(ids, offsets, cu) bytearrays of sampling-mask supports, or None (see _pyspeedups)."},
    {"sampled_rows", (PyCFunction)(void (*)(void))sampled_rows, METH_FASTCALL,
     "sampled_rows(padded, counts, /)\n--\n\n"
     "(values, offsets, k) of the sampled-ids column from staged host copies, or None (see "
     "_pyspeedups)."},
    {"message_custom_metadata", (PyCFunction)(void (*)(void))message_custom_metadata,
     METH_FASTCALL,
     "message_custom_metadata(meta, /)\n--\n\n"
     "The custom_metadata pairs of an IPC Message flatbuffer, or None (see _pyspeedups)."},
    {"int32_head", (PyCFunction)(void (*)(void))int32_head, METH_FASTCALL,
     "int32_head(values, n, /)\n--\n\n"
     "A copy of a 1-D int32 buffer's first n items, or None (see _pyspeedups)."},
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(a, b, /)\n--\n\n"
     "Whether two exact lists hold the same objects in order (see _pyspeedups)."},
    {"int_offsets", (PyCFunction)(void (*)(void))int_offsets, METH_FASTCALL,
     "int_offsets(values, last, /)\n--\n\n"
     "int32 offsets bytes of a list of ints from 0 to last, or None (see _pyspeedups)."},
    {"offsets_ok", (PyCFunction)(void (*)(void))offsets_ok, METH_FASTCALL,
     "offsets_ok(values, last, /)\n--\n\n"
     "Whether values are Arrow offsets from 0 to last, never decreasing (see _pyspeedups)."},
    {"build_array", (PyCFunction)(void (*)(void))build_array, METH_FASTCALL,
     "build_array(node, /)\n--\n\n"
     "(capsule, address) of an ArrowArray tree over the nodes' buffers (see batch.py)."},
    {"array_slot", (PyCFunction)(void (*)(void))array_slot, METH_FASTCALL,
     "array_slot(/)\n--\n\n"
     "(capsule, address) of an empty ArrowArray to export a record batch into."},
    {"decode_batch", (PyCFunction)(void (*)(void))decode_batch, METH_FASTCALL,
     "decode_batch(capsule, n, columns, step, absent, sampled, logprobs, mask, known, /)\n--\n\n"
     "The decoded objects of an exported record batch, or None (see batch.py)."},
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
