// A served request's JSON columns (Python lists) -> the raw batch's buffers, in one native pass
// per kind of column, holding the GIL (it walks Python objects). Not graph ops: they run before
// the model, on values orjson decoded. Each returns None where a value is not one of the common
// kinds; the request then takes the general path (serving/request.py's arrow_batch), which
// converts it or names the bad value. Both give the same batch, bit for bit.
//
// The tensors are made here too: views of one tensor per kind (a view made from Python cost
// ~0.7 us, 52 of them for DLRM's string columns).
//
//   deeprec._C.float_rows(columns, n)  -> [float32 [n]] per column, views of one [len, n] | None
//       values: float, None (NaN), int with |v| <= 2**24 (exact in float32); an inf after the
//       cast to float32 (an inf sent, or beyond float32) -> None
//   deeprec._C.int_rows(values, n)     -> int64 [n] | None
//       values: int within int64, None (-1: missing)
//   deeprec._C.string_rows(columns, n) -> [(uint8 bytes, int64 offsets [n + 1] from 0)] per column,
//                                         views of one buffer and one offsets tensor | None
//       a column: a list of n values (str as UTF-8, bytes, None -> b"", int as its decimal
//       text) or None (absent: n times b"")
//   deeprec._C.bytes_elements(buffer, count) -> [bytes] * count | (i, at)
//       Triton's BYTES tensor: each element a 4-byte little-endian length, then its bytes. Where
//       it does not parse: (i, at), element i ends past the buffer (i < count), or bytes are left
//       after the count-th (i == count, at: where they start); the caller names it.
#include <Python.h>
#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr long long kExact = 1LL << 24;  // ints up to this convert to float32 exactly

bool rows_ok(Py_ssize_t n) {
  if (n >= 0) return true;
  PyErr_Format(PyExc_ValueError, "rows must be >= 0, got %zd", n);
  return false;
}

// A 1-d tensor over `base`'s storage from `offset`: made directly, not through the dispatcher
// (narrow / select cost ~0.5 us each). Its base is a fresh buffer no graph tracks, so no view
// metadata is needed.
at::Tensor part_of(const at::Tensor& base, int64_t offset, int64_t size) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_sizes_and_strides(c10::IntArrayRef{size}, c10::IntArrayRef{1}, std::optional<int64_t>(offset));
  return at::Tensor(std::move(impl));
}

// [view(0), ..., view(count - 1)] as a Python list (nullptr on error).
template <typename View>
PyObject* tensor_list(Py_ssize_t count, View view) {
  PyObject* list = PyList_New(count);
  if (list == nullptr) return nullptr;
  for (Py_ssize_t c = 0; c < count; ++c) {
    PyObject* item = view(c);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, c, item);
  }
  return list;
}

PyObject* float_rows_impl(PyObject* args) {
  PyObject* columns;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &columns, &n) || !rows_ok(n)) return nullptr;
  const Py_ssize_t count = PyList_GET_SIZE(columns);
  at::Tensor whole = at::empty({count, n}, at::kFloat);
  float* cursor = whole.data_ptr<float>();
  for (Py_ssize_t c = 0; c < count; ++c) {
    PyObject* values = PyList_GET_ITEM(columns, c);
    if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != n) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = PyList_GET_ITEM(values, i);
      float f;
      if (PyFloat_CheckExact(v)) {
        f = static_cast<float>(PyFloat_AS_DOUBLE(v));
        if (std::isinf(f)) Py_RETURN_NONE;  // an inf, or beyond float32: the general path names it
      } else if (v == Py_None) {
        f = NAN;
      } else if (PyLong_CheckExact(v)) {
        int overflow = 0;
        const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow != 0 || x < -kExact || x > kExact) Py_RETURN_NONE;
        f = static_cast<float>(x);
      } else {
        Py_RETURN_NONE;
      }
      *cursor++ = f;
    }
  }
  return tensor_list(count, [&](Py_ssize_t c) { return THPVariable_Wrap(part_of(whole, c * n, n)); });
}

PyObject* int_rows_impl(PyObject* args) {
  PyObject* values;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &values, &n) || !rows_ok(n)) return nullptr;
  if (PyList_GET_SIZE(values) != n) Py_RETURN_NONE;
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* ids = out.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PyList_GET_ITEM(values, i);
    if (v == Py_None) {
      ids[i] = -1;
      continue;
    }
    if (!PyLong_CheckExact(v)) Py_RETURN_NONE;  // a bool, a float, text
    int overflow = 0;
    ids[i] = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0) Py_RETURN_NONE;  // beyond int64
  }
  return THPVariable_Wrap(std::move(out));
}

// The UTF-8 of each value, the texts made for int ids kept alive until copied.
struct Pieces {
  std::vector<const char*> starts;
  std::vector<PyObject*> made;
  ~Pieces() {
    for (PyObject* text : made) Py_DECREF(text);
  }
};

enum class Read { kOk, kRefuse, kError };

// One value's bytes; kRefuse: not a common value (left to the general path).
Read read_string(PyObject* v, Pieces& pieces, const char** start, Py_ssize_t* size) {
  *start = nullptr;
  *size = 0;
  if (PyUnicode_CheckExact(v)) {
    *start = PyUnicode_AsUTF8AndSize(v, size);
    if (*start == nullptr) {  // a lone surrogate: not UTF-8, named by the general path
      PyErr_Clear();
      return Read::kRefuse;
    }
  } else if (v == Py_None) {
  } else if (PyBytes_CheckExact(v)) {
    *start = PyBytes_AS_STRING(v);
    *size = PyBytes_GET_SIZE(v);
  } else if (PyLong_CheckExact(v)) {
    PyObject* text = PyObject_Str(v);
    if (text == nullptr) return Read::kError;
    pieces.made.push_back(text);
    *start = PyUnicode_AsUTF8AndSize(text, size);
    if (*start == nullptr) return Read::kError;
  } else {
    return Read::kRefuse;
  }
  return Read::kOk;
}

PyObject* string_rows_impl(PyObject* args) {
  PyObject* columns;
  Py_ssize_t n;
  if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &columns, &n) || !rows_ok(n)) return nullptr;
  const Py_ssize_t count = PyList_GET_SIZE(columns);
  at::Tensor offsets = at::empty({count, n + 1}, at::kLong);
  int64_t* offset = offsets.data_ptr<int64_t>();
  Pieces pieces;
  pieces.starts.assign(static_cast<size_t>(count * n), nullptr);
  std::vector<int64_t> column_start(count + 1, 0);
  for (Py_ssize_t c = 0; c < count; ++c) {
    PyObject* values = PyList_GET_ITEM(columns, c);
    int64_t* ends = offset + c * (n + 1);
    ends[0] = 0;
    if (values == Py_None) {
      std::fill(ends + 1, ends + n + 1, 0);
    } else {
      if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != n) Py_RETURN_NONE;
      for (Py_ssize_t i = 0; i < n; ++i) {
        Py_ssize_t size;
        const Read read = read_string(PyList_GET_ITEM(values, i), pieces, &pieces.starts[c * n + i], &size);
        if (read == Read::kRefuse) Py_RETURN_NONE;
        if (read == Read::kError) return nullptr;
        ends[i + 1] = ends[i] + size;
      }
    }
    column_start[c + 1] = column_start[c] + ends[n];
  }
  at::Tensor data = at::empty({column_start[count]}, at::kByte);
  char* cursor = reinterpret_cast<char*>(data.data_ptr<uint8_t>());
  for (Py_ssize_t c = 0; c < count; ++c) {
    const int64_t* ends = offset + c * (n + 1);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const int64_t size = ends[i + 1] - ends[i];
      if (size > 0) std::memcpy(cursor, pieces.starts[c * n + i], static_cast<size_t>(size));
      cursor += size;
    }
  }
  return tensor_list(count, [&](Py_ssize_t c) -> PyObject* {
    PyObject* values = THPVariable_Wrap(part_of(data, column_start[c], column_start[c + 1] - column_start[c]));
    PyObject* ends = THPVariable_Wrap(part_of(offsets, c * (n + 1), n + 1));
    if (values == nullptr || ends == nullptr) {
      Py_XDECREF(values);
      Py_XDECREF(ends);
      return nullptr;
    }
    PyObject* pair = PyTuple_Pack(2, values, ends);
    Py_DECREF(values);
    Py_DECREF(ends);
    return pair;
  });
}

PyObject* bytes_elements_impl(PyObject* args) {
  Py_buffer view;
  Py_ssize_t count;
  if (!PyArg_ParseTuple(args, "y*n", &view, &count)) return nullptr;
  const unsigned char* data = static_cast<const unsigned char*>(view.buf);
  const Py_ssize_t size = view.len;
  auto length_at = [&](Py_ssize_t at) {
    return static_cast<Py_ssize_t>(static_cast<uint32_t>(data[at]) | static_cast<uint32_t>(data[at + 1]) << 8 |
                                   static_cast<uint32_t>(data[at + 2]) << 16 |
                                   static_cast<uint32_t>(data[at + 3]) << 24);
  };
  // First the layout alone, so a count the client claims allocates nothing until the data holds it.
  Py_ssize_t at = 0, i = 0;
  for (; i < count; ++i) {
    if (at + 4 > size || length_at(at) > size - at - 4) break;
    at += 4 + length_at(at);
  }
  if (count < 0 || i < count || at != size) {
    PyBuffer_Release(&view);
    return count < 0 ? PyErr_Format(PyExc_ValueError, "count must be >= 0, got %zd", count)
                     : Py_BuildValue("(nn)", i, at);
  }
  PyObject* out = PyList_New(count);
  for (Py_ssize_t k = 0, from = 0; out != nullptr && k < count; ++k) {
    const Py_ssize_t length = length_at(from);
    PyObject* element = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data + from + 4), length);
    if (element == nullptr) {
      Py_CLEAR(out);  // the elements made so far go with it (the rest are NULL)
      break;
    }
    PyList_SET_ITEM(out, k, element);
    from += 4 + length;
  }
  PyBuffer_Release(&view);
  return out;
}

// A C++ exception (an allocation failing) becomes a Python exception, never std::terminate.
template <PyObject* (*Impl)(PyObject*)>
PyObject* guarded(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  return Impl(args);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"float_rows", guarded<float_rows_impl>, METH_VARARGS, "number columns (lists) -> a float32 tensor each, or None"},
    {"int_rows", guarded<int_rows_impl>, METH_VARARGS, "an int id column (a list) -> an int64 tensor, or None"},
    {"string_rows", guarded<string_rows_impl>, METH_VARARGS, "string id columns (lists or None) -> (bytes, offsets) each, or None"},
    {"bytes_elements", guarded<bytes_elements_impl>, METH_VARARGS, "a BYTES tensor's elements -> [bytes], or (i, at) where it fails"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
// `import deeprec._C` loads this library: its static initializers register the torch ops
// (feature_ops.cpp and the rest); the module holds the request converters above.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}
}
