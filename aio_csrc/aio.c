/* Asynchronous file I/O for infinity: placeholder module until the engines land. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *engines(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("[s]", "threads");
}

static PyMethodDef methods[] = {
    {"engines", engines, METH_NOARGS, "I/O engines this kernel allows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_aio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__aio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m) PyModule_AddStringConstant(m, "__version__", "0.1.0");
    return m;
}
