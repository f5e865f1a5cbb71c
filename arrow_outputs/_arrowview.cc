/* arrow_outputs._arrowview: a record batch's buffers for the C decode walk, without an export.
 *
 * export_into(batch, address) -> bool
 *
 * The decode walk (_speedups.decode_batch) reads a batch through the Arrow C Data Interface:
 * an ArrowArray tree that pyarrow fills with RecordBatch._export_to_c. That export allocates
 * per node (the struct array of the columns, one private block per node) and costs about
 * 10 us for a step's 41 nodes, a third of a small step's decode. export_into fills the same
 * tree from the batch's own ArrayData, in one block: every node, buffer pointer and child
 * pointer the exporter would give (same lengths, offsets, null counts, buffer order), and a
 * release callback that drops the reference it takes to the batch. The tree borrows the
 * batch's buffers, which a record batch never changes, for as long as the tree lives.
 *
 * It fills the tree only for layouts whose ArrowArray is their ArrayData as it is: the
 * fixed-width, binary, list, fixed-size-list, struct and null layouts (and extension types
 * over them), on CPU memory, without dictionaries, at most 64 levels deep. For anything
 * else it returns False with the slot untouched, and the caller exports it with pyarrow.
 *
 * Built against pyarrow's own C++ library (setup.py), so it only loads into the pyarrow it
 * was built against: a module built for another version refuses to import
 * (arrow_outputs._accel then exports with pyarrow, as where it was never built). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arrow/array/data.h>
#include <arrow/c/abi.h>
#include <arrow/config.h>
#include <arrow/extension_type.h>
#include <arrow/python/pyarrow.h>
#include <arrow/record_batch.h>
#include <arrow/type.h>
#include <arrow/util/config.h>

#include <cstdint>
#include <cstring>
#include <memory>

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
    // The interface lets a consumer release from any thread.
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(block->batch);
    PyGILState_Release(gil);
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

PyObject *
export_into(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "export_into() takes 2 arguments (%zd given)", nargs);
        return nullptr;
    }
    PyObject *obj = args[0];
    if (!arrow::py::is_batch(obj)) {
        PyErr_Format(PyExc_TypeError, "export_into(): expected a pyarrow.RecordBatch, got %s",
                     Py_TYPE(obj)->tp_name);
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
    arrow::Result<std::shared_ptr<arrow::RecordBatch>> got = arrow::py::unwrap_batch(obj);
    if (!got.ok()) {
        PyErr_SetString(PyExc_TypeError, "export_into(): not a usable pyarrow.RecordBatch");
        return nullptr;
    }
    const arrow::RecordBatch &batch = **got;
    const int ncols = batch.num_columns();
    Sizes s;
    s.buffers = 1;  // the root's validity (none)
    s.children = static_cast<size_t>(ncols);
    for (int i = 0; i < ncols; i++) {
        const std::shared_ptr<arrow::ArrayData> &col = batch.column_data(i);
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
        fill(*batch.column_data(i), child, &at);
    }
    Py_INCREF(obj);
    block->batch = obj;
    root->private_data = block;
    root->release = release_root;
    Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"export_into", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(export_into)),
     METH_FASTCALL,
     "export_into(batch, address) -> bool: fill the empty ArrowArray at address with a view of "
     "the batch's buffers (the tree RecordBatch._export_to_c would give), holding the batch "
     "until it is released; False, with the slot untouched, for a layout it does not mirror."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "arrow_outputs._arrowview",
    "A record batch's buffers as an ArrowArray tree without pyarrow's export (decode).",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC
PyInit__arrowview(void)
{
    // Only the libarrow this was compiled against: its ArrayData layout is what fill reads.
    const std::string &running = arrow::GetBuildInfo().version_string;
    if (running != ARROW_VERSION_STRING) {
        PyErr_Format(PyExc_ImportError,
                     "arrow_outputs._arrowview was built against Arrow %s, and Arrow %s is "
                     "loaded; reinstall arrow-outputs to rebuild it",
                     ARROW_VERSION_STRING, running.c_str());
        return nullptr;
    }
    if (arrow::py::import_pyarrow() != 0) {
        return nullptr;
    }
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
