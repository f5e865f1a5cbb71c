/* arrow_outputs._arrowbridge: the C accelerator's two crossings into pyarrow, done in Arrow's
 * own C++ library instead of through pyarrow's Python API.
 *
 * export_into(batch, address) -> bool                                  (decode)
 * assemble(schema, n, columns, metadata) -> RecordBatch | None                (encode)
 * schema_address(batch) -> int                                          (decode)
 * proven_valid(batch) -> bool                                          (decode, readers)
 * write_message(batch, metadata, dest, at) -> int | None               (sharing)
 * read_message(data, schema) -> (RecordBatch, [(key, value)]) | None     (sharing)
 *
 * Decode. The walk (_speedups.decode_batch) reads a batch through the Arrow C Data
 * Interface: an ArrowArray tree that pyarrow fills with RecordBatch._export_to_c. That export
 * allocates per node (the struct array of the columns, one private block per node) and costs
 * about 10 us for a step's 41 nodes, a third of a small step's decode. export_into fills the
 * same tree from the batch's own ArrayData, in one block: every node, buffer pointer and
 * child pointer the exporter would give (same lengths, offsets, null counts, buffer order),
 * and a release callback that drops the reference it takes to the batch. The tree borrows the
 * batch's buffers, which a record batch never changes, for as long as the tree lives.
 * It fills the tree only for layouts whose ArrowArray is their ArrayData as it is: the
 * fixed-width, binary, list, fixed-size-list, struct and null layouts (and extension types
 * over them), on CPU memory, without dictionaries, at most 64 levels deep. For anything
 * else it returns False with the slot untouched, and the caller exports it with pyarrow.
 *
 * Encode. The codec hands its columns to _accel.record_batch as nodes (length, null_count,
 * buffers, children: tuples over the objects whose memory holds the values) and as pyarrow
 * arrays (the all-null columns of absent fields). Through pyarrow's API that batch takes five
 * kinds of calls: _speedups.build_array's ArrowArray tree imported with
 * RecordBatch._import_from_c, Schema.with_metadata, RecordBatch.validate, and one
 * add_column per array column (each a new schema and batch). assemble makes the same batch
 * in one call from the nodes themselves: each buffer an Arrow buffer over the object's own
 * memory (held until Arrow lets go; no copy), each node column checked as from_buffers
 * checks it (its shape against the field's type, then ValidateArray with the buffers' real
 * sizes, which an imported tree does not carry), each array column as add_column checks it
 * (type and length). It declines (None) whatever it does not take, and the caller then runs
 * the specification, _pyspeedups.record_batch, which makes the batch or raises its error.
 *
 * Validation. A batch from elsewhere must pass RecordBatch.validate(full=True) before
 * anything is read by its offsets. For a small step that costs a third of the decode, most of
 * it per node (the layout vector ValidateLayout builds, the boxed column arrays), not in the
 * checks. proven_valid makes the same checks, stricter, in one walk over the ArrayData: True
 * means every rule of full validation holds (so pyarrow's would pass); False only means
 * "not proven" (a layout or a shape it does not take, or a broken rule), and the caller then
 * runs pyarrow's validation, which passes or words the error. It takes offset-0 arrays on
 * CPU memory of fixed-width numeric, (large) string and binary, (large) list, fixed-size
 * list and struct types (and extension types over them), and requires of them what full
 * validation requires and more: child types equal to their parent's field types, aligned
 * offsets, UTF-8 in every string slot (null ones too). The rules are those of the Arrow it
 * is built against (this module loads into no other); tests/test_proven_valid.py holds it
 * to them over mutated streams.
 *
 * Sharing. A publisher writes each step as one IPC record-batch message into a slot's shared
 * pages. Through pyarrow's stream writer that is a writer call that collects dictionaries
 * (none here), the step metadata made into a KeyValueMetadata object (about 3 us from a
 * dict), and seek and tell calls. write_message writes the same bytes (the message Arrow's
 * stream writer gives, then the end-of-stream marker) into a writable buffer at an offset
 * in one call, and returns where they end; None when they do not fit or for anything it
 * does not take, and the caller writes with pyarrow (which also says why). A subscriber
 * reads a slot's message back with read_message: Arrow's ReadMessage and ReadRecordBatch
 * (the very calls under pyarrow's read_message and read_record_batch), with the message's
 * custom metadata, in one call; None for anything but one whole record-batch message that
 * Arrow reads, and the caller then reads with pyarrow, which words the error.
 *
 * Built against pyarrow's own C++ library (setup.py), so it only loads into the pyarrow it
 * was built against: a module built for another version refuses to import, and
 * arrow_outputs._accel then uses pyarrow's export and import, as where it was never built. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arrow/array/array_base.h>
#include <arrow/array/data.h>
#include <arrow/array/validate.h>
#include <arrow/c/abi.h>
#include <arrow/config.h>
#include <arrow/extension_type.h>
#include <arrow/io/memory.h>
#include <arrow/ipc/message.h>
#include <arrow/ipc/reader.h>
#include <arrow/ipc/writer.h>
#include <arrow/python/pyarrow.h>
#include <arrow/record_batch.h>
#include <arrow/type.h>
#include <arrow/util/config.h>
#include <arrow/util/bitmap_ops.h>
#include <arrow/util/key_value_metadata.h>
#include <arrow/util/utf8.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace {

// The nesting depth the IPC reader allows; deeper trees go to pyarrow's exporter.
constexpr int kMaxDepth = 64;

struct Sizes {
    size_t nodes = 0;
    size_t buffers = 0;
    size_t children = 0;
};

// Whether the exporter's ArrowArray of this layout is its ArrayData as it is (and how many
// leading buffers it drops: the null layout has no validity bitmap in the interface).
bool
mirrored(const arrow::DataType &type, size_t *skip)
{
    const arrow::DataType *t = &type;
    if (t->id() == arrow::Type::EXTENSION) {
        t = static_cast<const arrow::ExtensionType *>(t)->storage_type().get();
    }
    *skip = 0;
    switch (t->id()) {
    case arrow::Type::NA:
        *skip = 1;
        return true;
    case arrow::Type::DICTIONARY:
    case arrow::Type::EXTENSION:  // an extension over an extension: not in this format
    case arrow::Type::SPARSE_UNION:
    case arrow::Type::DENSE_UNION:
    case arrow::Type::RUN_END_ENCODED:
    case arrow::Type::STRING_VIEW:
    case arrow::Type::BINARY_VIEW:
    case arrow::Type::LIST_VIEW:
    case arrow::Type::LARGE_LIST_VIEW:
        return false;
    default:
        return true;
    }
}

// Counts the tree's nodes, buffers and child pointers; false when a node is not mirrored.
bool
measure(const arrow::ArrayData &d, int depth, Sizes *s)
{
    size_t skip;
    if (depth > kMaxDepth || d.dictionary != nullptr || !mirrored(*d.type, &skip) ||
        d.buffers.size() < skip) {
        return false;
    }
    for (const auto &b : d.buffers) {
        if (b != nullptr && !b->is_cpu()) {
            return false;
        }
    }
    s->nodes += 1;
    s->buffers += d.buffers.size() - skip;
    s->children += d.child_data.size();
    for (const auto &c : d.child_data) {
        if (c == nullptr || !measure(*c, depth + 1, s)) {
            return false;
        }
    }
    return true;
}

// The block a filled tree lives in: the batch it borrows from, then the nodes (the root is
// the caller's slot), the buffer pointers and the child pointers.
struct Block {
    PyObject *batch;
};

struct Cursor {
    ArrowArray *nodes;
    const void **buffers;
    ArrowArray **children;
};

// A child's release: the block (and the batch) go with the root.
void
release_child(ArrowArray *a)
{
    a->release = nullptr;
}

void
release_root(ArrowArray *a)
{
    Block *block = static_cast<Block *>(a->private_data);
    // The interface lets a consumer release from any thread. At interpreter exit the batch
    // is gone with the interpreter: leave it (as _speedups' trees do).
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(block->batch);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(block);
    a->release = nullptr;
}

void
fill(const arrow::ArrayData &d, ArrowArray *out, Cursor *at)
{
    size_t skip;
    mirrored(*d.type, &skip);
    out->length = d.length;
    out->offset = d.offset;
    out->null_count = d.null_count.load();  // -1 (unknown) is the interface's too
    out->n_buffers = static_cast<int64_t>(d.buffers.size() - skip);
    out->buffers = at->buffers;
    for (size_t i = skip; i < d.buffers.size(); i++) {
        *at->buffers++ = d.buffers[i] != nullptr ? d.buffers[i]->data() : nullptr;
    }
    out->n_children = static_cast<int64_t>(d.child_data.size());
    out->children = at->children;
    at->children += d.child_data.size();
    out->dictionary = nullptr;
    out->private_data = nullptr;
    out->release = release_child;
    for (size_t i = 0; i < d.child_data.size(); i++) {
        ArrowArray *child = at->nodes++;
        out->children[i] = child;
        fill(*d.child_data[i], child, at);
    }
}

// The C++ batch of a pyarrow.RecordBatch; null, with a TypeError naming fn, for anything else.
std::shared_ptr<arrow::RecordBatch>
batch_of(PyObject *obj, const char *fn)
{
    if (arrow::py::is_batch(obj)) {
        arrow::Result<std::shared_ptr<arrow::RecordBatch>> got = arrow::py::unwrap_batch(obj);
        if (got.ok() && *got != nullptr) {
            return *std::move(got);
        }
    }
    PyErr_Format(PyExc_TypeError, "%s(): expected a pyarrow.RecordBatch, got %s", fn,
                 Py_TYPE(obj)->tp_name);
    return nullptr;
}

PyObject *
export_into(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "export_into() takes 2 arguments (%zd given)", nargs);
        return nullptr;
    }
    PyObject *obj = args[0];
    const std::shared_ptr<arrow::RecordBatch> got = batch_of(obj, "export_into");
    if (got == nullptr) {
        return nullptr;
    }
    void *address = PyLong_AsVoidPtr(args[1]);
    if (address == nullptr) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "export_into(): the address is 0");
        }
        return nullptr;
    }
    ArrowArray *root = static_cast<ArrowArray *>(address);
    if (root->release != nullptr) {
        PyErr_SetString(PyExc_ValueError, "export_into(): the slot holds an unreleased array");
        return nullptr;
    }
    const arrow::RecordBatch &batch = *got;
    const int ncols = batch.num_columns();
    Sizes s;
    s.buffers = 1;  // the root's validity (none)
    s.children = static_cast<size_t>(ncols);
    // The columns as the batch holds them: column_data(i) would copy each shared_ptr.
    const arrow::ArrayDataVector &columns = batch.column_data();
    if (columns.size() != static_cast<size_t>(ncols)) {
        Py_RETURN_FALSE;
    }
    for (int i = 0; i < ncols; i++) {
        const std::shared_ptr<arrow::ArrayData> &col = columns[static_cast<size_t>(i)];
        if (col == nullptr || !measure(*col, 1, &s)) {
            Py_RETURN_FALSE;
        }
    }
    const size_t bytes = sizeof(Block) + s.nodes * sizeof(ArrowArray) +
                         s.buffers * sizeof(void *) + s.children * sizeof(ArrowArray *);
    char *mem = static_cast<char *>(PyMem_RawMalloc(bytes));
    if (mem == nullptr) {
        return PyErr_NoMemory();
    }
    Block *block = reinterpret_cast<Block *>(mem);
    Cursor at;
    at.nodes = reinterpret_cast<ArrowArray *>(mem + sizeof(Block));
    char *buffers_at = mem + sizeof(Block) + s.nodes * sizeof(ArrowArray);
    at.buffers = reinterpret_cast<const void **>(buffers_at);
    at.children = reinterpret_cast<ArrowArray **>(buffers_at + s.buffers * sizeof(void *));

    // The root: the struct array of the columns that the exporter makes of a batch.
    root->length = batch.num_rows();
    root->offset = 0;
    root->null_count = 0;
    root->n_buffers = 1;
    root->buffers = at.buffers;
    *at.buffers++ = nullptr;
    root->n_children = ncols;
    root->children = at.children;
    at.children += ncols;
    root->dictionary = nullptr;
    for (int i = 0; i < ncols; i++) {
        ArrowArray *child = at.nodes++;
        root->children[i] = child;
        fill(*columns[static_cast<size_t>(i)], child, &at);
    }
    Py_INCREF(obj);
    block->batch = obj;
    root->private_data = block;
    root->release = release_root;
    Py_RETURN_TRUE;
}

// The metadata dict (bytes to bytes) as Arrow's; false for anything else.
bool
metadata_of(PyObject *dict, std::shared_ptr<const arrow::KeyValueMetadata> *out)
{
    std::vector<std::string> keys, values;
    keys.reserve(static_cast<size_t>(PyDict_GET_SIZE(dict)));
    values.reserve(static_cast<size_t>(PyDict_GET_SIZE(dict)));
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (!PyBytes_CheckExact(key) || !PyBytes_CheckExact(value)) {
            return false;
        }
        keys.emplace_back(PyBytes_AS_STRING(key), static_cast<size_t>(PyBytes_GET_SIZE(key)));
        values.emplace_back(PyBytes_AS_STRING(value),
                            static_cast<size_t>(PyBytes_GET_SIZE(value)));
    }
    *out = arrow::KeyValueMetadata::Make(std::move(keys), std::move(values));
    return true;
}

// A node's buffer: the object's own memory, held (a Py_buffer) for as long as Arrow holds
// the buffer, and given back under the GIL from whatever thread drops it last.
class HeldBuffer : public arrow::Buffer {
  public:
    explicit HeldBuffer(const Py_buffer &view)
        : arrow::Buffer(static_cast<const uint8_t *>(view.buf), view.len), view_(view)
    {
    }
    ~HeldBuffer() override
    {
        if (Py_IsInitialized()) {  // at interpreter exit the object is gone with it
            PyGILState_STATE gil = PyGILState_Ensure();
            PyBuffer_Release(&view_);
            PyGILState_Release(gil);
        }
    }

  private:
    Py_buffer view_;
};

// The layouts a node states completely: _pyspeedups._NODE_LAYOUTS.
bool
node_layout(arrow::Type::type id)
{
    switch (id) {
    case arrow::Type::BOOL:
    case arrow::Type::INT8:
    case arrow::Type::INT16:
    case arrow::Type::INT32:
    case arrow::Type::INT64:
    case arrow::Type::UINT8:
    case arrow::Type::UINT16:
    case arrow::Type::UINT32:
    case arrow::Type::UINT64:
    case arrow::Type::HALF_FLOAT:
    case arrow::Type::FLOAT:
    case arrow::Type::DOUBLE:
    case arrow::Type::STRING:
    case arrow::Type::BINARY:
    case arrow::Type::LARGE_STRING:
    case arrow::Type::LARGE_BINARY:
    case arrow::Type::LIST:
    case arrow::Type::LARGE_LIST:
    case arrow::Type::FIXED_SIZE_LIST:
    case arrow::Type::STRUCT:
        return true;
    default:
        return false;
    }
}

// build_array's bounds on a tree.
constexpr int kMaxNodes = 1 << 16;

// The ArrayData that `node` = (length, null_count, buffers, children) describes as `type`;
// false (no Python error set) for a node that is not of that type's shape. Buffer sizes are
// the objects' own, so ValidateArray later checks them against the lengths.
bool
node_data(PyObject *node, const std::shared_ptr<arrow::DataType> &type, int depth, int *count,
          std::shared_ptr<arrow::ArrayData> *out)
{
    if (depth > kMaxDepth || ++*count > kMaxNodes || !PyTuple_CheckExact(node) ||
        PyTuple_GET_SIZE(node) != 4) {
        return false;
    }
    PyObject *length_obj = PyTuple_GET_ITEM(node, 0), *nulls_obj = PyTuple_GET_ITEM(node, 1);
    PyObject *bufs = PyTuple_GET_ITEM(node, 2), *kids = PyTuple_GET_ITEM(node, 3);
    if (!PyLong_CheckExact(length_obj) || !PyLong_CheckExact(nulls_obj) ||
        !PyTuple_CheckExact(bufs) || !PyTuple_CheckExact(kids)) {
        return false;
    }
    long long length = PyLong_AsLongLong(length_obj);
    long long nulls = PyLong_AsLongLong(nulls_obj);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    if (length < 0 || nulls < 0 || nulls > length) {
        return false;
    }
    const arrow::DataType *storage = type.get();
    if (storage->id() == arrow::Type::EXTENSION) {
        storage = static_cast<const arrow::ExtensionType *>(storage)->storage_type().get();
    }
    if (!node_layout(storage->id()) ||
        PyTuple_GET_SIZE(bufs) != static_cast<Py_ssize_t>(storage->layout().buffers.size()) ||
        PyTuple_GET_SIZE(kids) != storage->num_fields()) {
        return false;
    }
    std::vector<std::shared_ptr<arrow::Buffer>> buffers(static_cast<size_t>(PyTuple_GET_SIZE(bufs)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bufs); i++) {
        PyObject *obj = PyTuple_GET_ITEM(bufs, i);
        if (obj == Py_None) {
            continue;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            return false;
        }
        try {
            buffers[static_cast<size_t>(i)] = std::make_shared<HeldBuffer>(view);
        } catch (...) {
            PyBuffer_Release(&view);
            throw;
        }
    }
    std::vector<std::shared_ptr<arrow::ArrayData>> children(static_cast<size_t>(PyTuple_GET_SIZE(kids)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kids); i++) {
        if (!node_data(PyTuple_GET_ITEM(kids, i), storage->field(static_cast<int>(i))->type(),
                       depth + 1, count, &children[static_cast<size_t>(i)])) {
            return false;
        }
    }
    *out = arrow::ArrayData::Make(type, length, std::move(buffers), std::move(children), nulls);
    return true;
}

PyObject *
assemble_batch(PyObject *const *args)
{
    PyObject *columns = args[2], *meta = args[3];
    if (!arrow::py::is_schema(args[0]) || !PyLong_CheckExact(args[1]) ||
        !PyList_CheckExact(columns) || !(meta == Py_None || PyDict_CheckExact(meta))) {
        PyErr_SetString(PyExc_TypeError,
                        "assemble(schema: Schema, n: int, columns: list, metadata: dict | None)");
        return nullptr;
    }
    std::shared_ptr<arrow::Schema> schema = *arrow::py::unwrap_schema(args[0]);
    const int ncols = schema->num_fields();
    long long n = PyLong_AsLongLong(args[1]);
    if (n == -1 && PyErr_Occurred()) {
        return nullptr;
    }
    if (n < 0 || PyList_GET_SIZE(columns) != ncols) {
        Py_RETURN_NONE;
    }
    std::vector<std::shared_ptr<arrow::ArrayData>> data(static_cast<size_t>(ncols));
    int count = 0;
    for (int i = 0; i < ncols; i++) {
        PyObject *column = PyList_GET_ITEM(columns, i);
        const std::shared_ptr<arrow::DataType> &type = schema->field(i)->type();
        std::shared_ptr<arrow::ArrayData> &col = data[static_cast<size_t>(i)];
        if (PyTuple_CheckExact(column)) {
            // from_buffers' checks: the node's shape, then ValidateArray (buffer sizes
            // against lengths, first and last offsets) with the buffers' real sizes.
            if (!node_data(column, type, 1, &count, &col) || col->length != n ||
                !arrow::internal::ValidateArray(*col).ok()) {
                Py_RETURN_NONE;
            }
        } else if (arrow::py::is_array(column)) {
            // add_column's checks: the field's type and the batch's length.
            std::shared_ptr<arrow::Array> array = *arrow::py::unwrap_array(column);
            if (array->length() != n || !array->type()->Equals(*type)) {
                Py_RETURN_NONE;
            }
            col = array->data();
        } else {
            Py_RETURN_NONE;
        }
    }
    std::shared_ptr<arrow::Schema> target = schema;
    if (meta != Py_None) {
        std::shared_ptr<const arrow::KeyValueMetadata> kv;
        if (!metadata_of(meta, &kv)) {
            Py_RETURN_NONE;
        }
        target = schema->WithMetadata(kv);
    }
    return arrow::py::wrap_batch(arrow::RecordBatch::Make(std::move(target), n, std::move(data)));
}

PyObject *
assemble(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "assemble() takes 4 arguments (%zd given)", nargs);
        return nullptr;
    }
    try {
        return assemble_batch(args);
    } catch (const std::bad_alloc &) {
        return PyErr_NoMemory();
    }
}

// Whether the int32 or int64 offsets of d (offset 0, length n) are what full validation
// requires: present when n > 0, n + 1 of them, aligned, the first >= 0, non-decreasing,
// none above limit. An empty array may have no offsets; one that has a buffer has its
// first offset read and checked as well (pyarrow 26 checks it whenever the buffer is not
// empty).
template <typename O>
bool
offsets_proven(const arrow::ArrayData &d, int64_t limit)
{
    const int64_t n = d.length;
    const arrow::Buffer *buf = d.buffers[1].get();
    if (buf == nullptr || buf->address() == 0) {
        return n == 0;
    }
    if (n == 0 && buf->size() == 0) {
        return true;
    }
    const int64_t count = buf->size() / static_cast<int64_t>(sizeof(O));
    if (count < 1 || count - 1 < n || buf->address() % alignof(O) != 0) {
        return false;
    }
    const O *off = reinterpret_cast<const O *>(buf->data());
    O prev = off[0];
    if (prev < 0 || prev > limit) {
        return false;
    }
    for (int64_t i = 1; i <= n; i++) {
        const O cur = off[i];
        if (cur < prev || cur > limit) {
            return false;
        }
        prev = cur;
    }
    return true;
}

// Every slot of a string array valid UTF-8 (its offsets already proven).
template <typename O>
bool
utf8_proven(const arrow::ArrayData &d)
{
    const O *off = reinterpret_cast<const O *>(d.buffers[1]->data());
    const uint8_t *chars = d.buffers[2]->data();
    for (int64_t i = 0; i < d.length; i++) {
        if (!arrow::util::ValidateUTF8(chars + off[i], static_cast<int64_t>(off[i + 1] - off[i]))) {
            return false;
        }
    }
    return true;
}

// A (large) string or binary array's characters present, its offsets proven against them,
// and (for strings) every slot valid UTF-8.
template <typename O>
bool
binary_proven(const arrow::ArrayData &d, bool utf8)
{
    const arrow::Buffer *chars = d.buffers[2].get();
    return chars != nullptr && chars->address() != 0 && offsets_proven<O>(d, chars->size()) &&
           (!utf8 || d.length == 0 || utf8_proven<O>(d));
}

// The byte width of a fixed-width numeric type; 0 for any other type.
int
numeric_width(arrow::Type::type id)
{
    switch (id) {
    case arrow::Type::INT8:
    case arrow::Type::UINT8:
        return 1;
    case arrow::Type::INT16:
    case arrow::Type::UINT16:
    case arrow::Type::HALF_FLOAT:
        return 2;
    case arrow::Type::INT32:
    case arrow::Type::UINT32:
    case arrow::Type::FLOAT:
        return 4;
    case arrow::Type::INT64:
    case arrow::Type::UINT64:
    case arrow::Type::DOUBLE:
        return 8;
    default:
        return 0;
    }
}

// Whether d, an array of type `type`, meets every rule of full validation (see the top).
bool
proven(const arrow::ArrayData &d, const arrow::DataType &declared, int depth)
{
    if (depth > kMaxDepth || d.type == nullptr ||
        (d.type.get() != &declared && !d.type->Equals(declared))) {
        return false;
    }
    // An extension array is checked as its storage, as full validation checks it.
    const arrow::DataType &type =
        declared.id() == arrow::Type::EXTENSION
            ? *static_cast<const arrow::ExtensionType &>(declared).storage_type()
            : declared;
    const int64_t n = d.length;
    const int64_t nulls = d.null_count.load();
    const bool counted = nulls != arrow::kUnknownNullCount;  // else, as pyarrow: not checked
    if (n < 0 || d.offset != 0 || d.dictionary != nullptr || (counted && nulls < 0) || nulls > n ||
        d.child_data.size() != static_cast<size_t>(type.num_fields())) {
        return false;
    }
    for (const auto &b : d.buffers) {
        if (b != nullptr && !b->is_cpu()) {
            return false;
        }
    }
    const arrow::Type::type id = type.id();
    const int width = numeric_width(id);
    size_t nbuffers;
    if (width > 0) {
        nbuffers = 2;
    } else {
        switch (id) {
        case arrow::Type::STRING:
        case arrow::Type::BINARY:
        case arrow::Type::LARGE_STRING:
        case arrow::Type::LARGE_BINARY:
            nbuffers = 3;
            break;
        case arrow::Type::LIST:
        case arrow::Type::LARGE_LIST:
            nbuffers = 2;
            break;
        case arrow::Type::FIXED_SIZE_LIST:
        case arrow::Type::STRUCT:
            nbuffers = 1;
            break;
        default:
            return false;
        }
    }
    if (d.buffers.size() != nbuffers) {
        return false;
    }
    // The validity bitmap: big enough, and its unset bits exactly the null count (where the
    // count is known; an unknown one is not checked by full validation either).
    const arrow::Buffer *bits = d.buffers[0].get();
    if (bits == nullptr) {
        if (nulls > 0) {
            return false;
        }
    } else if (n > 0) {
        if (bits->size() < n / 8 + (n % 8 != 0) || bits->data() == nullptr ||
            (counted && n - arrow::internal::CountSetBits(bits->data(), 0, n) != nulls)) {
            return false;
        }
    }
    if (width > 0) {
        const arrow::Buffer *values = d.buffers[1].get();
        if (n == 0) {
            return true;
        }
        return values != nullptr && values->address() != 0 &&
               n <= std::numeric_limits<int64_t>::max() / width && values->size() >= n * width;
    }
    switch (id) {
    case arrow::Type::STRING:
        return binary_proven<int32_t>(d, true);
    case arrow::Type::BINARY:
        return binary_proven<int32_t>(d, false);
    case arrow::Type::LARGE_STRING:
        return binary_proven<int64_t>(d, true);
    case arrow::Type::LARGE_BINARY:
        return binary_proven<int64_t>(d, false);
    case arrow::Type::LIST:
    case arrow::Type::LARGE_LIST: {
        const arrow::ArrayData *values = d.child_data[0].get();
        if (values == nullptr ||
            !proven(*values, *static_cast<const arrow::BaseListType &>(type).value_type(),
                    depth + 1)) {
            return false;
        }
        return id == arrow::Type::LIST ? offsets_proven<int32_t>(d, values->length)
                                       : offsets_proven<int64_t>(d, values->length);
    }
    case arrow::Type::FIXED_SIZE_LIST: {
        const auto &fsl = static_cast<const arrow::FixedSizeListType &>(type);
        const int64_t size = fsl.list_size();
        const arrow::ArrayData *values = d.child_data[0].get();
        return values != nullptr && size >= 0 &&
               (size == 0 || n <= std::numeric_limits<int64_t>::max() / size) &&
               values->length >= n * size && proven(*values, *fsl.value_type(), depth + 1);
    }
    case arrow::Type::STRUCT:
        for (int i = 0; i < type.num_fields(); i++) {
            const arrow::ArrayData *field = d.child_data[static_cast<size_t>(i)].get();
            if (field == nullptr || field->length < n ||
                !proven(*field, *type.field(i)->type(), depth + 1)) {
                return false;
            }
        }
        return true;
    default:
        return false;
    }
}

bool
columns_proven(const arrow::RecordBatch &batch, const arrow::Schema &schema)
{
    const arrow::ArrayDataVector &columns = batch.column_data();  // no shared_ptr copies
    if (columns.size() != static_cast<size_t>(schema.num_fields())) {
        return false;
    }
    for (int i = 0; i < schema.num_fields(); i++) {
        const std::shared_ptr<arrow::ArrayData> &col = columns[static_cast<size_t>(i)];
        if (col == nullptr || col->length != batch.num_rows() ||
            !proven(*col, *schema.field(i)->type(), 1)) {
            return false;
        }
    }
    return true;
}

// Batches of more rows than this are checked (proven_valid) and written (write_message)
// without the GIL, as pyarrow's validation and writer run; smaller ones are done before
// another thread could have taken the GIL.
constexpr int64_t kReleaseGilRows = 256;

PyObject *
proven_valid(PyObject *, PyObject *obj)
{
    const std::shared_ptr<arrow::RecordBatch> got = batch_of(obj, "proven_valid");
    if (got == nullptr) {
        return nullptr;
    }
    const arrow::RecordBatch &batch = *got;
    const arrow::Schema &schema = *batch.schema();
    const int ncols = batch.num_columns();
    const int64_t rows = batch.num_rows();
    if (schema.num_fields() != ncols || rows < 0) {
        Py_RETURN_FALSE;
    }
    bool ok;
    if (rows > kReleaseGilRows) {
        Py_BEGIN_ALLOW_THREADS
        ok = columns_proven(batch, schema);
        Py_END_ALLOW_THREADS
    } else {
        ok = columns_proven(batch, schema);
    }
    return PyBool_FromLong(ok);
}

PyObject *
write_message(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "write_message() takes 4 arguments (%zd given)", nargs);
        return nullptr;
    }
    const std::shared_ptr<arrow::RecordBatch> got = batch_of(args[0], "write_message");
    if (got == nullptr) {
        return nullptr;
    }
    if (!PyDict_CheckExact(args[1])) {
        Py_RETURN_NONE;
    }
    const Py_ssize_t at = PyLong_AsSsize_t(args[3]);
    if (at == -1 && PyErr_Occurred()) {
        return nullptr;
    }
    std::shared_ptr<const arrow::KeyValueMetadata> metadata;
    if (!metadata_of(args[1], &metadata)) {
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        return nullptr;
    }
    if (at < 0 || at > view.len) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "write_message(): offset %zd outside a buffer of %zd bytes",
                     at, view.len);
        return nullptr;
    }
    static const uint8_t kEndOfStream[8] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
    const arrow::RecordBatch &batch = *got;
    auto target = std::make_shared<arrow::MutableBuffer>(static_cast<uint8_t *>(view.buf) + at,
                                                         static_cast<int64_t>(view.len - at));
    int64_t written = -1;
    auto write = [&]() {
        arrow::ipc::IpcWriteOptions options = arrow::ipc::IpcWriteOptions::Defaults();
        options.use_threads = false;
        arrow::ipc::IpcPayload payload;
        int32_t metadata_length = 0;
        arrow::io::FixedSizeBufferWriter out(target);
        if (!arrow::ipc::GetRecordBatchPayload(batch, metadata, options, &payload).ok() ||
            !arrow::ipc::WriteIpcPayload(payload, options, &out, &metadata_length).ok() ||
            !out.Write(kEndOfStream, sizeof kEndOfStream).ok()) {
            return;  // too large for the buffer, or anything else: pyarrow's writer says
        }
        arrow::Result<int64_t> end = out.Tell();
        written = end.ok() ? *end : -1;
    };
    try {
        if (batch.num_rows() > kReleaseGilRows) {
            Py_BEGIN_ALLOW_THREADS
            write();
            Py_END_ALLOW_THREADS
        } else {
            write();
        }
    } catch (const std::bad_alloc &) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    PyBuffer_Release(&view);
    if (written < 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromSsize_t(at + static_cast<Py_ssize_t>(written));
}

PyObject *
read_message(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "read_message() takes 2 arguments (%zd given)", nargs);
        return nullptr;
    }
    if (!arrow::py::is_buffer(args[0]) || !arrow::py::is_schema(args[1])) {
        PyErr_Format(PyExc_TypeError,
                     "read_message(): expected a pyarrow.Buffer and a pyarrow.Schema, got %s "
                     "and %s",
                     Py_TYPE(args[0])->tp_name, Py_TYPE(args[1])->tp_name);
        return nullptr;
    }
    arrow::Result<std::shared_ptr<arrow::Buffer>> data = arrow::py::unwrap_buffer(args[0]);
    arrow::Result<std::shared_ptr<arrow::Schema>> schema = arrow::py::unwrap_schema(args[1]);
    if (!data.ok() || !schema.ok() || *data == nullptr || *schema == nullptr ||
        !(*data)->is_cpu()) {
        Py_RETURN_NONE;
    }
    std::shared_ptr<arrow::RecordBatch> batch;
    std::shared_ptr<const arrow::KeyValueMetadata> custom;
    try {
        arrow::io::BufferReader reader(*data);
        arrow::Result<std::unique_ptr<arrow::ipc::Message>> message =
            arrow::ipc::ReadMessage(&reader);
        if (!message.ok() || *message == nullptr ||
            (*message)->type() != arrow::ipc::MessageType::RECORD_BATCH) {
            Py_RETURN_NONE;
        }
        arrow::Result<int64_t> end = reader.Tell();
        if (!end.ok() || *end != (*data)->size()) {
            Py_RETURN_NONE;
        }
        arrow::Result<std::shared_ptr<arrow::RecordBatch>> read = arrow::ipc::ReadRecordBatch(
            **message, *schema, nullptr, arrow::ipc::IpcReadOptions::Defaults());
        if (!read.ok() || *read == nullptr) {
            Py_RETURN_NONE;
        }
        batch = *std::move(read);
        custom = (*message)->custom_metadata();
    } catch (const std::bad_alloc &) {
        return PyErr_NoMemory();
    }
    const int64_t npairs = custom == nullptr ? 0 : custom->size();
    PyObject *pairs = PyList_New(static_cast<Py_ssize_t>(npairs));
    if (pairs == nullptr) {
        return nullptr;
    }
    for (int64_t i = 0; i < npairs; i++) {
        const std::string &k = custom->key(i);
        const std::string &v = custom->value(i);
        PyObject *pair = Py_BuildValue("(y#y#)", k.data(), static_cast<Py_ssize_t>(k.size()),
                                       v.data(), static_cast<Py_ssize_t>(v.size()));
        if (pair == nullptr) {
            Py_DECREF(pairs);
            return nullptr;
        }
        PyList_SET_ITEM(pairs, static_cast<Py_ssize_t>(i), pair);
    }
    PyObject *wrapped = arrow::py::wrap_batch(batch);
    if (wrapped == nullptr) {
        Py_DECREF(pairs);
        return nullptr;
    }
    PyObject *out = PyTuple_Pack(2, wrapped, pairs);
    Py_DECREF(wrapped);
    Py_DECREF(pairs);
    return out;
}

// The address of a batch's C++ schema: batches read from one stream (or made against one
// schema object) share it, so it keys what is derived from the schema alone.
PyObject *
schema_address(PyObject *, PyObject *obj)
{
    const std::shared_ptr<arrow::RecordBatch> got = batch_of(obj, "schema_address");
    return got == nullptr ? nullptr : PyLong_FromVoidPtr(got->schema().get());
}

PyMethodDef methods[] = {
    {"export_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(export_into)),
     METH_FASTCALL,
     "export_into(batch, address) -> bool: fill the empty ArrowArray at address with a view of "
     "the batch's buffers (the tree RecordBatch._export_to_c would give), holding the batch "
     "until it is released; False, with the slot untouched, for a layout it does not mirror."},
    {"assemble", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(assemble)),
     METH_FASTCALL,
     "assemble(schema, n, columns, metadata) -> RecordBatch | None: the batch of n rows whose "
     "columns are nodes (length, null_count, buffers, children) or pyarrow arrays, under "
     "schema with metadata (bytes to bytes) as its schema metadata; no copy, checked as "
     "from_buffers and add_column check; None for anything else (the specification, "
     "_pyspeedups.record_batch, then makes it or raises its error)."},
    {"proven_valid", proven_valid, METH_O,
     "proven_valid(batch) -> bool: True when the batch meets every rule of "
     "RecordBatch.validate(full=True), by a stricter check of the layouts this format uses; "
     "False when that is not proven (pyarrow's validation then decides and words the error)."},
    {"write_message", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(write_message)),
     METH_FASTCALL,
     "write_message(batch, metadata, dest, at) -> int | None: write the batch's IPC message "
     "with metadata (a dict of bytes to bytes) as its custom metadata, then the end-of-stream "
     "marker, into the writable buffer dest from offset at, as Arrow's stream writer writes "
     "them; the offset where they end, or None when they do not fit or it does not take the "
     "arguments (nothing to rely on is written then)."},
    {"read_message", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(read_message)),
     METH_FASTCALL,
     "read_message(data, schema) -> (RecordBatch, [(key, value)]) | None: the record batch "
     "of the one IPC message that fills the buffer data (its buffers slices of data), read "
     "against schema as pyarrow's read_message and read_record_batch read it, with the "
     "message's custom metadata; None for anything else (pyarrow then says what is wrong)."},
    {"schema_address", schema_address, METH_O,
     "schema_address(batch) -> int: the address of the batch's C++ schema, shared by the "
     "batches of one stream; a key only while that schema is held alive."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "arrow_outputs._arrowbridge",
    "The C accelerator's crossings into pyarrow, in Arrow's C++ library (export_into, assemble).",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC
PyInit__arrowbridge(void)
{
    // Only the Arrow this was compiled against, both as linked (its ArrayData layout is what
    // fill reads) and as the pyarrow module in use (whose objects it unwraps): a library
    // found elsewhere by its versioned name cannot stand in for the one pyarrow loaded.
    const std::string &linked = arrow::GetBuildInfo().version_string;
    PyObject *pyarrow = PyImport_ImportModule("pyarrow");
    if (pyarrow == nullptr) {
        return nullptr;
    }
    PyObject *version = PyObject_GetAttrString(pyarrow, "cpp_version");
    Py_DECREF(pyarrow);
    if (version == nullptr) {
        return nullptr;
    }
    const char *in_use = PyUnicode_Check(version) ? PyUnicode_AsUTF8(version) : nullptr;
    const bool same = in_use != nullptr && linked == ARROW_VERSION_STRING &&
                      std::strcmp(in_use, ARROW_VERSION_STRING) == 0;
    if (!same) {
        PyErr_Clear();
        PyErr_Format(PyExc_ImportError,
                     "arrow_outputs._arrowbridge was built against Arrow %s, and pyarrow's "
                     "Arrow is %s (linked: %s); reinstall arrow-outputs to rebuild it",
                     ARROW_VERSION_STRING, in_use == nullptr ? "unknown" : in_use,
                     linked.c_str());
        Py_DECREF(version);
        return nullptr;
    }
    Py_DECREF(version);
    if (arrow::py::import_pyarrow() != 0) {
        return nullptr;
    }
    arrow::util::InitializeUTF8();  // ValidateUTF8's tables
    PyObject *m = PyModule_Create(&module);
    if (m == nullptr) {
        return nullptr;
    }
    if (PyModule_AddStringConstant(m, "ARROW_VERSION", ARROW_VERSION_STRING) != 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
