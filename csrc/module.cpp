// The Python module apex_lite._C. Importing it loads the shared library, whose static
// initialisers register the ops (ops.cpp) and their kernels (cpu/, cuda/) with the dispatcher;
// Python calls them as torch.ops.apex_lite.<op>. Its one function is a reference count read,
// which no op can do: referenced_elsewhere (amp's master gradients keep torch's lifetimes by
// reusing only what no user code holds, apex_lite/amp/master_grads.py; the Python backend's
// reference is apex_lite/multi_tensor/_watches.py).
#include <Python.h>

namespace {

// referenced_elsewhere(objects: list, own: int) -> list[int]: the indices of the objects whose
// reference count exceeds the `own` references the caller holds (the list among them).
PyObject* referenced_elsewhere(PyObject* /*module*/, PyObject* args) {
  PyObject* objects = nullptr;
  Py_ssize_t own = 0;
  if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &objects, &own)) return nullptr;
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(objects);
  const Py_ssize_t limit = own;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_REFCNT(PyList_GET_ITEM(objects, i)) > limit) {
      PyObject* index = PyLong_FromSsize_t(i);
      if (index == nullptr || PyList_Append(out, index) != 0) {
        Py_XDECREF(index);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(index);
    }
  }
  return out;
}

PyMethodDef methods[] = {
    {"referenced_elsewhere", referenced_elsewhere, METH_VARARGS,
     "The indices of the list's objects that something holds besides the `own` references of "
     "the caller's (the list among them)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}
