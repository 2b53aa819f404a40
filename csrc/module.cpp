// The Python module apex_lite._C. It holds no functions: importing it loads the shared library,
// whose static initialisers register the ops (ops.cpp) and their kernels (cpu/, cuda/) with the
// dispatcher; Python calls them as torch.ops.apex_lite.<op>.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
