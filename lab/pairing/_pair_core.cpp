// The lockstep pair's per-output path in C++: `lab/pairing/pair_core.py` builds and loads it.
//
// `Reporter` is what `lockstep._reporting_forwards` installs as a captured module's instance
// forward, and `Lockstep` is `_Lockstep._on_output` for the common case: outputs that are a
// plain tensor, or a tuple or list of plain tensors (and Nones). Both do what the Python code
// does, step for step, on the same Python objects (the step's dicts, the `Aliases` names, the
// `FlowRecorder` tables, the `Collector`'s pending list and batches), so the Result, the dtype
// flow and the skips are the same; anything else (a tensor subclass, a nested or mapping
// output, an inference tensor) is handed to the Python method before any state is touched.
// What the Python code reads through the binding layer (`_version`, `shape`, `numel`, `_base`)
// is read here from the at::Tensor itself.
#include <Python.h>
#include <structmember.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---- set once by `setup` --------------------------------------------------------------------

PyObject* g_tensor = nullptr;   // torch.Tensor
PyObject* g_pending = nullptr;  // collect._Pending
PyObject* g_skipped = nullptr;  // result.Skipped
PyObject* g_question = nullptr; // "?"
int64_t g_defer_numel = 0, g_flush_numel = 0, g_device_pairs = 0, g_device_batch_numel = 0;
// Byte offsets of `_Pending`'s slots (order, module, call, output, module_class, dtype_a,
// dtype_b, shape, stats, hist, same_as).
constexpr int kPendingFields = 11;
Py_ssize_t g_pending_at[kPendingFields];
PyObject* g_idx[64]; // "0".."63": output indices of tuple leaves
PyObject* g_empty = nullptr;

#define NAMES(X)                                                                               \
  X(_names) X(_count) X(pending) X(_by_names) X(repeats) X(_reduce) X(_reducer) X(copies)     \
  X(_device_batch) X(_device_bytes) X(batch_bytes) X(_flush_device) X(_reduce_on_device)      \
  X(_batch) X(_batch_numel) X(flush) X(_reduce_now) X(compare) X(names) X(skipped) X(order)   \
  X(b_leaves) X(_pause) X(_base) X(dtype) X(same_as) X(_on_output) X(_version)
struct Names {
#define DECLARE(n) PyObject* n = nullptr;
  NAMES(DECLARE)
#undef DECLARE
} s;

bool intern_names() {
#define INTERN(n)                                                                              \
  if ((s.n = PyUnicode_InternFromString(#n)) == nullptr) return false;
  NAMES(INTERN)
#undef INTERN
  return true;
}

// ---- small helpers ----------------------------------------------------------------------------

// An owned reference that drops itself.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  PyObject* get() const { return p; }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
  void reset(PyObject* o) {
    Py_XDECREF(p);
    p = o;
  }
  explicit operator bool() const { return p != nullptr; }
};

struct PyFailed {}; // a Python exception is set

inline PyObject* check(PyObject* o) {
  if (o == nullptr) throw PyFailed{};
  return o;
}
inline void check_rc(int rc) {
  if (rc < 0) throw PyFailed{};
}

inline bool is_plain_tensor(PyObject* o) { return (PyObject*)Py_TYPE(o) == g_tensor; }

inline bool is_tensor(PyObject* o) {
  if (is_plain_tensor(o)) return true;
  int r = PyObject_IsInstance(o, g_tensor);
  check_rc(r);
  return r == 1;
}

inline const at::Tensor& unpack(PyObject* o) { return THPVariable_Unpack(o); }

inline PyObject* id_of(PyObject* o) { return check(PyLong_FromVoidPtr(o)); }

inline int64_t as_int(PyObject* o) {
  int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw PyFailed{};
  return v;
}

inline int64_t get_int(PyObject* obj, PyObject* name) {
  Ref v(check(PyObject_GetAttr(obj, name)));
  return as_int(v.get());
}

inline void set_int(PyObject* obj, PyObject* name, int64_t value) {
  Ref v(check(PyLong_FromLongLong(value)));
  check_rc(PyObject_SetAttr(obj, name, v.get()));
}

// A new reference to dict[key], or nullptr when absent.
inline PyObject* dict_get(PyObject* dict, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(dict, key);
  if (v == nullptr && PyErr_Occurred()) throw PyFailed{};
  Py_XINCREF(v);
  return v;
}

inline PyObject* call_method(PyObject* obj, PyObject* name, std::initializer_list<PyObject*> args) {
  PyObject* stack[8];
  stack[0] = obj;
  size_t n = 1;
  for (PyObject* a : args) stack[n++] = a;
  return check(PyObject_VectorcallMethod(name, stack, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
}

// The referent of weakref `ref` is `obj` (a dead or other referent is not).
inline bool refers_to(PyObject* ref, PyObject* obj) { return PyWeakref_GetObject(ref) == obj; }

// ---- the per-step state -------------------------------------------------------------------------

struct Lockstep {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* step;
  PyObject* collector;
  PyObject* module_classes;
  PyObject* keys[2];       // "a", "b"
  PyObject* calls[2];      // step.calls[key]
  PyObject* held[2];       // step.held[key]
  PyObject* aliases[2];    // step.aliases[key] (for `_count`)
  PyObject* names[2];      // step.aliases[key]._names
  PyObject* reasons[2];    // "only on side 'NAME'" of each side
  PyObject* parked;        // step.parked
  PyObject* done;          // step.done
  PyObject* skip_keys;     // step.skip_keys
  PyObject* inputs[2];     // flow.inputs[key]
  PyObject* produced;      // flow.produced
  PyObject* bases;         // flow._bases
  PyObject* flow_names;    // flow._aliases._names, or nullptr: producers not tracked
  int segments;
  int64_t budget;
  int64_t handled;         // outputs this object paired or parked itself
  int64_t handed;          // outputs it handed to the Python method
};

// Aliases.name: the tensor's name in its forward's namespace.
PyObject* alias_name(Lockstep* self, int side, PyObject* tensor) {
  PyObject* names = self->names[side];
  Ref key(id_of(tensor));
  int64_t version = unpack(tensor)._version();
  Ref known(dict_get(names, key.get()));
  if (known && refers_to(PyTuple_GET_ITEM(known.get(), 0), tensor) &&
      as_int(PyTuple_GET_ITEM(known.get(), 1)) == version) {
    PyObject* name = PyTuple_GET_ITEM(known.get(), 2);
    Py_INCREF(name);
    return name;
  }
  int64_t count = get_int(self->aliases[side], s._count) + 1;
  Ref name(check(PyLong_FromLongLong(count)));
  check_rc(PyObject_SetAttr(self->aliases[side], s._count, name.get()));
  Ref ref(check(PyWeakref_NewRef(tensor, nullptr)));
  Ref ver(check(PyLong_FromLongLong(version)));
  Ref entry(check(PyTuple_Pack(3, ref.get(), ver.get(), name.get())));
  check_rc(PyDict_SetItem(names, key.get(), entry.get()));
  return name.release();
}

// Aliases.known on a names dict: a new reference to the name, or nullptr.
PyObject* known_name(PyObject* names, PyObject* tensor) {
  Ref key(id_of(tensor));
  Ref known(dict_get(names, key.get()));
  if (known && refers_to(PyTuple_GET_ITEM(known.get(), 0), tensor) &&
      as_int(PyTuple_GET_ITEM(known.get(), 1)) == unpack(tensor)._version()) {
    PyObject* name = PyTuple_GET_ITEM(known.get(), 2);
    Py_INCREF(name);
    return name;
  }
  return nullptr;
}

// FlowRecorder._producer: a new reference (None when unknown).
PyObject* producer(Lockstep* self, PyObject* tensor) {
  Ref name(known_name(self->flow_names, tensor));
  if (name) {
    PyObject* found = dict_get(self->produced, name.get());
    if (found == nullptr) Py_RETURN_NONE;
    return found;
  }
  if (!unpack(tensor).is_view()) Py_RETURN_NONE;
  Ref base(check(PyObject_GetAttr(tensor, s._base)));
  if (base.get() == Py_None) Py_RETURN_NONE;
  name.reset(known_name(self->flow_names, base.get()));
  if (name) {
    PyObject* found = dict_get(self->produced, name.get());
    if (found == nullptr) Py_RETURN_NONE;
    return found;
  }
  Ref base_id(id_of(base.get()));
  Ref noted(dict_get(self->bases, base_id.get()));
  if (noted && refers_to(PyTuple_GET_ITEM(noted.get(), 0), base.get()) &&
      as_int(PyTuple_GET_ITEM(noted.get(), 1)) == unpack(base.get())._version()) {
    PyObject* found = PyTuple_GET_ITEM(noted.get(), 2);
    Py_INCREF(found);
    return found;
  }
  Py_RETURN_NONE;
}

// One InputEntry: (argument, dtype, producer or None, id).
PyObject* input_entry(Lockstep* self, bool track, PyObject* argument, PyObject* value) {
  Ref dtype(check(PyObject_GetAttr(value, s.dtype)));
  Ref found(track ? producer(self, value) : (Py_INCREF(Py_None), Py_None));
  Ref id(id_of(value));
  return check(PyTuple_Pack(4, argument, dtype.get(), found.get(), id.get()));
}

// FlowRecorder.record.
void flow_record(Lockstep* self, int side, PyObject* label, PyObject* call, PyObject* args,
                 PyObject* kwargs) {
  bool track = side == 0 && self->flow_names != nullptr;
  Ref where(check(PyTuple_Pack(2, label, call)));
  bool no_kwargs = kwargs == nullptr || PyDict_GET_SIZE(kwargs) == 0;
  if (no_kwargs && PyTuple_GET_SIZE(args) == 1 && is_tensor(PyTuple_GET_ITEM(args, 0))) {
    Ref zero(check(PyLong_FromLong(0)));
    Ref entry(input_entry(self, track, zero.get(), PyTuple_GET_ITEM(args, 0)));
    Ref entries(check(PyTuple_Pack(1, entry.get())));
    check_rc(PyDict_SetItem(self->inputs[side], where.get(), entries.get()));
    return;
  }
  Ref entries(check(PyList_New(0)));
  auto one = [&](PyObject* key, PyObject* value) {
    if (is_tensor(value)) {
      Ref entry(input_entry(self, track, key, value));
      check_rc(PyList_Append(entries.get(), entry.get()));
    } else if (PyTuple_CheckExact(value) || PyList_CheckExact(value)) {
      Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      for (Py_ssize_t j = 0; j < n; ++j) {
        PyObject* item = PySequence_Fast_GET_ITEM(value, j);
        if (!is_tensor(item)) continue;
        Ref jj(check(PyLong_FromSsize_t(j)));
        Ref argument(check(PyTuple_Pack(2, key, jj.get())));
        Ref entry(input_entry(self, track, argument.get(), item));
        check_rc(PyList_Append(entries.get(), entry.get()));
      }
    }
  };
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); ++i) {
    Ref key(check(PyLong_FromSsize_t(i)));
    one(key.get(), PyTuple_GET_ITEM(args, i));
  }
  if (!no_kwargs) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &value)) one(key, value);
  }
  Ref tuple(check(PyList_AsTuple(entries.get())));
  check_rc(PyDict_SetItem(self->inputs[side], where.get(), tuple.get()));
}

// FlowRecorder.note_output (side A).
void note_output(Lockstep* self, PyObject* name, PyObject* key, PyObject* leaf) {
  if (PyDict_SetDefault(self->produced, name, key) == nullptr) throw PyFailed{};
  if (!unpack(leaf).is_view()) return;
  Ref base(check(PyObject_GetAttr(leaf, s._base)));
  if (base.get() == Py_None) return;
  Ref base_id(id_of(base.get()));
  Ref noted(dict_get(self->bases, base_id.get()));
  if (noted && refers_to(PyTuple_GET_ITEM(noted.get(), 0), base.get())) return;
  Ref ref(check(PyWeakref_NewRef(base.get(), nullptr)));
  Ref ver(check(PyLong_FromLongLong(unpack(base.get())._version())));
  Ref entry(check(PyTuple_Pack(3, ref.get(), ver.get(), key)));
  check_rc(PyDict_SetItem(self->bases, base_id.get(), entry.get()));
}

inline void set_slot(PyObject* obj, int field, PyObject* value) {
  PyObject** at = (PyObject**)((char*)obj + g_pending_at[field]);
  Py_INCREF(value);
  PyObject* old = *at;
  *at = value;
  Py_XDECREF(old);
}

// Collector.compare's common case (two plain floating tensors of one shape): the `_Pending`,
// the repeat check and the batch; anything else goes to `Collector.compare`. Returns whether
// the leaves were skipped.
bool compare(Lockstep* self, PyObject* order, PyObject* key, PyObject* a, PyObject* b,
             PyObject* name_a, PyObject* name_b) {
  PyObject* collector = self->collector;
  Ref names(check(PyTuple_Pack(2, name_a, name_b)));
  bool fast = is_plain_tensor(a) && is_plain_tensor(b);
  if (fast) {
    const at::Tensor& ta = unpack(a);
    const at::Tensor& tb = unpack(b);
    fast = at::isFloatingType(ta.scalar_type()) && at::isFloatingType(tb.scalar_type()) &&
           ta.sizes().equals(tb.sizes());
  }
  if (!fast) {
    Ref args(check(PyTuple_Pack(4, order, key, a, b)));
    Ref kw(check(PyDict_New()));
    check_rc(PyDict_SetItem(kw.get(), s.names, names.get()));
    Ref method(check(PyObject_GetAttr(collector, s.compare)));
    Ref skipped(check(PyObject_Call(method.get(), args.get(), kw.get())));
    int truth = PyObject_IsTrue(skipped.get());
    check_rc(truth);
    return truth == 1;
  }
  const at::Tensor& ta = unpack(a);
  const at::Tensor& tb = unpack(b);
  PyObject* label = PyTuple_GET_ITEM(key, 0);
  Ref pending(check(((PyTypeObject*)g_pending)->tp_alloc((PyTypeObject*)g_pending, 0)));
  Ref module_class(dict_get(self->module_classes, label));
  Ref dtype_a(check(PyObject_GetAttr(a, s.dtype)));
  Ref dtype_b(check(PyObject_GetAttr(b, s.dtype)));
  auto sizes = ta.sizes();
  Ref shape(check(PyTuple_New((Py_ssize_t)sizes.size())));
  for (size_t d = 0; d < sizes.size(); ++d)
    PyTuple_SET_ITEM(shape.get(), d, check(PyLong_FromLongLong(sizes[d])));
  PyObject* fields[kPendingFields] = {
      order, label, PyTuple_GET_ITEM(key, 1), PyTuple_GET_ITEM(key, 2),
      module_class ? module_class.get() : g_question, dtype_a.get(), dtype_b.get(), shape.get(),
      Py_None, Py_None, Py_None};
  for (int f = 0; f < kPendingFields; ++f) set_slot(pending.get(), f, fields[f]);
  {
    Ref list(check(PyObject_GetAttr(collector, s.pending)));
    check_rc(PyList_Append(list.get(), pending.get()));
  }
  {
    Ref by_names(check(PyObject_GetAttr(collector, s._by_names)));
    Ref earlier(dict_get(by_names.get(), names.get()));
    if (earlier) {
      set_slot(pending.get(), 10, earlier.get());
      set_int(collector, s.repeats, get_int(collector, s.repeats) + 1);
      return false;
    }
    check_rc(PyDict_SetItem(by_names.get(), names.get(), pending.get()));
  }
  int64_t n = ta.numel();
  Ref copies(check(PyObject_GetAttr(collector, s.copies)));
  int copy = PyObject_IsTrue(copies.get());
  check_rc(copy);
  if (ta.is_cuda()) {
    Ref reduce(check(PyObject_GetAttr(collector, s._reduce)));
    Ref reducer(check(PyObject_GetAttr(collector, s._reducer)));
    if (reduce.get() == Py_None || reducer.get() == Py_None || copy || n <= 0 ||
        n >= g_device_batch_numel) {
      Ref done(call_method(collector, s._reduce_on_device, {pending.get(), a, b}));
      return false;
    }
    Ref va(check(PyLong_FromLongLong(ta._version())));
    Ref vb(check(PyLong_FromLongLong(tb._version())));
    Ref entry(check(PyTuple_Pack(5, pending.get(), a, b, va.get(), vb.get())));
    Ref batch(check(PyObject_GetAttr(collector, s._device_batch)));
    check_rc(PyList_Append(batch.get(), entry.get()));
    int64_t bytes = get_int(collector, s._device_bytes) +
                    n * (int64_t)(ta.element_size() + tb.element_size());
    set_int(collector, s._device_bytes, bytes);
    if (PyList_GET_SIZE(batch.get()) >= g_device_pairs ||
        bytes >= get_int(collector, s.batch_bytes)) {
      Ref done(call_method(collector, s._flush_device, {}));
    }
    return false;
  }
  if (copy || n >= g_defer_numel) {
    Ref done(call_method(collector, s._reduce_now, {pending.get(), a, b}));
    return false;
  }
  Ref va(check(PyLong_FromLongLong(ta._version())));
  Ref vb(check(PyLong_FromLongLong(tb._version())));
  Ref entry(check(PyTuple_Pack(5, pending.get(), a, b, va.get(), vb.get())));
  Ref batch(check(PyObject_GetAttr(collector, s._batch)));
  check_rc(PyList_Append(batch.get(), entry.get()));
  int64_t total = get_int(collector, s._batch_numel) + n;
  set_int(collector, s._batch_numel, total);
  if (total >= g_flush_numel) {
    Ref done(call_method(collector, s.flush, {}));
  }
  return false;
}

inline PyObject* pair_of(int64_t first, int64_t second) {
  Ref x(check(PyLong_FromLongLong(first)));
  Ref y(check(PyLong_FromLongLong(second)));
  return check(PyTuple_Pack(2, x.get(), y.get()));
}

// Whether the C++ path takes this output: a plain tensor, or a tuple/list of plain tensors and
// Nones (up to 64 leaves), none of them an inference tensor.
bool takes(PyObject* output) {
  if (is_plain_tensor(output)) return !unpack(output).is_inference();
  if (!(PyTuple_Check(output) || PyList_Check(output))) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(output);
  if (n > 64) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(output, i);
    if (item == Py_None) continue;
    if (!is_plain_tensor(item) || unpack(item).is_inference()) return false;
  }
  return true;
}

// _Lockstep._on_output, for an output `takes` accepts.
void on_output(Lockstep* self, int side, PyObject* label, PyObject* args, PyObject* kwargs,
               PyObject* output) {
  bool is_a = side == 0;
  int other = 1 - side;
  PyObject* key = self->keys[side];
  PyObject* calls = self->calls[side];
  Ref call(dict_get(calls, label));
  if (!call) call.reset(check(PyLong_FromLong(0)));
  {
    Ref next(check(PyLong_FromLongLong(as_int(call.get()) + 1)));
    check_rc(PyDict_SetItem(calls, label, next.get()));
  }
  flow_record(self, side, label, call.get(), args, kwargs);
  PyObject* theirs_held = self->held[other];
  bool parked = false;
  bool bare = is_plain_tensor(output);
  Py_ssize_t count = bare ? 1 : PySequence_Fast_GET_SIZE(output);
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* leaf = bare ? output : PySequence_Fast_GET_ITEM(output, i);
    if (leaf == Py_None) continue;
    PyObject* idx = bare ? g_empty : g_idx[i];
    Ref k(check(PyTuple_Pack(3, label, call.get(), idx)));
    Ref name(alias_name(self, side, leaf));
    int64_t seq = -1;
    if (is_a) {
      note_output(self, name.get(), k.get(), leaf);
    } else {
      seq = get_int(self->step, s.b_leaves);
      set_int(self->step, s.b_leaves, seq + 1);
    }
    Ref theirs;
    {
      PyObject* found = PyDict_GetItemWithError(theirs_held, k.get());
      if (found == nullptr && PyErr_Occurred()) throw PyFailed{};
      if (found != nullptr) {
        Py_INCREF(found);
        theirs.reset(found);
        check_rc(PyDict_DelItem(theirs_held, k.get()));
      }
    }
    if (theirs) {
      PyObject* entry = theirs.get(); // [order, leaf, copied, name, version, B's sequence]
      bool skipped;
      if (is_a) {
        int64_t order = get_int(self->step, s.order);
        set_int(self->step, s.order, order + 1);
        seq = as_int(PyList_GET_ITEM(entry, 5));
        Ref order_obj(check(PyLong_FromLongLong(order)));
        skipped = compare(self, order_obj.get(), k.get(), leaf, PyList_GET_ITEM(entry, 1),
                          name.get(), PyList_GET_ITEM(entry, 3));
      } else {
        skipped = compare(self, PyList_GET_ITEM(entry, 0), k.get(), PyList_GET_ITEM(entry, 1),
                          leaf, PyList_GET_ITEM(entry, 3), name.get());
      }
      if (skipped) {
        Ref sk(pair_of(0, seq));
        check_rc(PyList_Append(self->skip_keys, sk.get()));
      }
      continue;
    }
    Ref other_done(dict_get(self->done, self->keys[other]));
    int done = other_done ? PyObject_IsTrue(other_done.get()) : 0;
    check_rc(done);
    if (done) {
      Ref collector_skipped(check(PyObject_GetAttr(self->collector, s.skipped)));
      Ref row(check(PyObject_CallFunctionObjArgs(g_skipped, label, call.get(), idx,
                                                 self->reasons[side], nullptr)));
      check_rc(PyList_Append(collector_skipped.get(), row.get()));
      Ref sk;
      if (is_a) {
        int64_t order = get_int(self->step, s.order);
        set_int(self->step, s.order, order + 1);
        sk.reset(pair_of(1, order));
      } else {
        sk.reset(pair_of(0, seq));
      }
      check_rc(PyList_Append(self->skip_keys, sk.get()));
      continue;
    }
    int64_t order = -1;
    if (is_a) {
      order = get_int(self->step, s.order);
      set_int(self->step, s.order, order + 1);
    }
    const at::Tensor& t = unpack(leaf);
    Ref order_obj(check(PyLong_FromLongLong(order)));
    Ref version(check(PyLong_FromLongLong(t._version())));
    Ref seq_obj(check(PyLong_FromLongLong(is_a ? -1 : seq)));
    Ref entry(check(PyList_New(6)));
    PyObject* items[6] = {order_obj.get(), leaf, Py_False, name.get(), version.get(),
                          seq_obj.get()};
    for (int j = 0; j < 6; ++j) {
      Py_INCREF(items[j]);
      PyList_SET_ITEM(entry.get(), j, items[j]);
    }
    check_rc(PyDict_SetItem(self->held[side], k.get(), entry.get()));
    Ref was(dict_get(self->parked, key));
    int64_t bytes = (was ? as_int(was.get()) : 0) + 1 + t.numel() * (int64_t)t.element_size();
    Ref now(check(PyLong_FromLongLong(bytes)));
    check_rc(PyDict_SetItem(self->parked, key, now.get()));
    parked = true;
  }
  if (parked) {
    bool pause = !self->segments;
    if (!pause) {
      Ref now(dict_get(self->parked, key));
      pause = now && as_int(now.get()) > self->budget;
    }
    if (pause) {
      Ref done(call_method(self->step, s._pause, {key}));
    }
  }
}

// Translate a C++ exception into the Python one the Python code would have raised.
void set_error(const std::exception& err) {
  if (PyErr_Occurred()) return;
  if (auto* c10err = dynamic_cast<const c10::Error*>(&err)) {
    PyErr_SetString(PyExc_RuntimeError, c10err->what_without_backtrace());
  } else {
    PyErr_SetString(PyExc_RuntimeError, err.what());
  }
}

// Lockstep(step, key, label, args, kwargs, output) as `_Lockstep._on_output(key, ...)`.
PyObject* lockstep_call(Lockstep* self, PyObject* key, PyObject* label, PyObject* args,
                        PyObject* kwargs, PyObject* output) {
  int side;
  if (key == self->keys[0]) {
    side = 0;
  } else if (key == self->keys[1]) {
    side = 1;
  } else {
    int eq = PyObject_RichCompareBool(key, self->keys[0], Py_EQ);
    if (eq < 0) return nullptr;
    side = eq ? 0 : 1;
  }
  try {
    if (!PyTuple_CheckExact(args) || (kwargs != nullptr && !PyDict_CheckExact(kwargs)) ||
        !PyUnicode_CheckExact(label) || !takes(output)) {
      self->handed += 1;
      Ref kw(kwargs != nullptr ? (Py_INCREF(kwargs), kwargs) : check(PyDict_New()));
      Ref done(call_method(self->step, s._on_output, {key, label, args, kw.get(), output}));
      Py_RETURN_NONE;
    }
    self->handled += 1;
    on_output(self, side, label, args, kwargs, output);
  } catch (const PyFailed&) {
    return nullptr;
  } catch (const std::exception& err) {
    set_error(err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* lockstep_vectorcall(PyObject* obj, PyObject* const* args, size_t nargsf,
                              PyObject* kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (n != 5 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError,
                    "Lockstep(key, label, args, kwargs, output): five positional arguments");
    return nullptr;
  }
  PyObject* kwargs = args[3] == Py_None ? nullptr : args[3];
  return lockstep_call((Lockstep*)obj, args[0], args[1], args[2], kwargs, args[4]);
}

PyObject* lockstep_tp_call(PyObject* obj, PyObject* args, PyObject* kwargs) {
  return PyVectorcall_Call(obj, args, kwargs);
}

#define LOCKSTEP_REFS(X)                                                                       \
  X(step) X(collector) X(module_classes) X(keys[0]) X(keys[1]) X(calls[0]) X(calls[1])        \
  X(held[0]) X(held[1]) X(aliases[0]) X(aliases[1]) X(names[0]) X(names[1]) X(reasons[0])    \
  X(reasons[1]) X(parked) X(done) X(skip_keys) X(inputs[0]) X(inputs[1]) X(produced) X(bases) \
  X(flow_names)

int lockstep_traverse(Lockstep* self, visitproc visit, void* arg) {
#define VISIT(f) Py_VISIT(self->f);
  LOCKSTEP_REFS(VISIT)
#undef VISIT
  return 0;
}

int lockstep_clear(Lockstep* self) {
#define CLEAR(f) Py_CLEAR(self->f);
  LOCKSTEP_REFS(CLEAR)
#undef CLEAR
  return 0;
}

void lockstep_dealloc(Lockstep* self) {
  PyObject_GC_UnTrack(self);
  lockstep_clear(self);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

PyObject* lockstep_counts(Lockstep* self, PyObject*) {
  return Py_BuildValue("(LL)", (long long)self->handled, (long long)self->handed);
}

PyMethodDef lockstep_methods[] = {
    {"counts", (PyCFunction)lockstep_counts, METH_NOARGS,
     "(outputs handled here, outputs handed to `_Lockstep._on_output`)"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject LockstepType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Lockstep.__new__(step, state): `state` is the dict `pair_core.lockstep` builds.
PyObject* lockstep_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *step, *state;
  if (!PyArg_ParseTuple(args, "OO!", &step, &PyDict_Type, &state)) return nullptr;
  Lockstep* self = (Lockstep*)type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  self->step = (Py_INCREF(step), step);
  auto item = [&](const char* name, bool optional = false) -> PyObject* {
    PyObject* v = PyDict_GetItemString(state, name);
    if (v == nullptr || (optional && v == Py_None)) {
      if (!optional && !PyErr_Occurred())
        PyErr_Format(PyExc_KeyError, "Lockstep state: no %s", name);
      return nullptr;
    }
    Py_INCREF(v);
    return v;
  };
  self->collector = item("collector");
  self->module_classes = item("module_classes");
  self->keys[0] = item("key_a");
  self->keys[1] = item("key_b");
  self->calls[0] = item("calls_a");
  self->calls[1] = item("calls_b");
  self->held[0] = item("held_a");
  self->held[1] = item("held_b");
  self->aliases[0] = item("aliases_a");
  self->aliases[1] = item("aliases_b");
  self->names[0] = item("names_a");
  self->names[1] = item("names_b");
  self->reasons[0] = item("reason_a");
  self->reasons[1] = item("reason_b");
  self->parked = item("parked");
  self->done = item("done");
  self->skip_keys = item("skip_keys");
  self->inputs[0] = item("inputs_a");
  self->inputs[1] = item("inputs_b");
  self->produced = item("produced");
  self->bases = item("bases");
  self->flow_names = item("flow_names", true);
  PyObject* segments = PyDict_GetItemString(state, "segments");
  PyObject* budget = PyDict_GetItemString(state, "budget");
  if (PyErr_Occurred() || segments == nullptr || budget == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "Lockstep state: segments, budget");
    Py_DECREF(self);
    return nullptr;
  }
  self->segments = PyObject_IsTrue(segments);
  self->budget = PyLong_AsLongLong(budget);
  if (PyErr_Occurred()) {
    Py_DECREF(self);
    return nullptr;
  }
  // Every dict and list must be what the Python code holds (checked once).
  PyObject* dicts[] = {self->module_classes, self->calls[0], self->calls[1], self->held[0],
                       self->held[1], self->names[0], self->names[1], self->parked, self->done,
                       self->inputs[0], self->inputs[1], self->produced, self->bases};
  for (PyObject* d : dicts) {
    if (d == nullptr || !PyDict_Check(d)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Lockstep state: a dict expected");
      Py_DECREF(self);
      return nullptr;
    }
  }
  if (self->skip_keys == nullptr || !PyList_Check(self->skip_keys) || self->keys[0] == nullptr ||
      self->keys[1] == nullptr || self->reasons[0] == nullptr || self->reasons[1] == nullptr ||
      self->collector == nullptr || self->aliases[0] == nullptr || self->aliases[1] == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Lockstep state: incomplete");
    Py_DECREF(self);
    return nullptr;
  }
  self->handled = self->handed = 0;
  self->vectorcall = lockstep_vectorcall;
  return (PyObject*)self;
}

// ---- Reporter: a captured module's instance forward ---------------------------------------------

struct Reporter {
  PyObject_HEAD
  PyObject* inner;     // the forward it wraps
  PyObject* label;     // the module's label
  PyObject* on_output; // a Lockstep, or any callable taking (key, label, args, kwargs, output)
  PyObject* keys;      // lockstep._KEYS: thread ident -> side key
};

PyObject* reporter_call(PyObject* obj, PyObject* args, PyObject* kwargs) {
  Reporter* self = (Reporter*)obj;
  PyObject* output = PyObject_Call(self->inner, args, kwargs);
  if (output == nullptr) return nullptr;
  PyObject* ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
  if (ident == nullptr) {
    Py_DECREF(output);
    return nullptr;
  }
  PyObject* key = PyDict_GetItemWithError(self->keys, ident); // borrowed
  Py_DECREF(ident);
  if (key == nullptr) {
    if (PyErr_Occurred()) {
      Py_DECREF(output);
      return nullptr;
    }
    return output;
  }
  int truth = PyObject_IsTrue(key);
  if (truth <= 0) {
    if (truth < 0) {
      Py_DECREF(output);
      return nullptr;
    }
    return output;
  }
  Py_INCREF(key);
  // Out of sight of the autocast emulation's torch-function mode, as `DisableTorchFunction`.
  auto old = at::impl::PythonTorchFunctionTLS::get_disabled_state();
  at::impl::PythonTorchFunctionTLS::set_disabled_state(
      at::impl::TorchFunctionDisabledState::ALL_DISABLED);
  PyObject* done;
  if (Py_TYPE(self->on_output) == &LockstepType) {
    done = lockstep_call((Lockstep*)self->on_output, key, self->label, args, kwargs, output);
  } else {
    PyObject* kw = kwargs != nullptr ? (Py_INCREF(kwargs), kwargs) : PyDict_New();
    done = kw == nullptr ? nullptr
                         : PyObject_CallFunctionObjArgs(self->on_output, key, self->label, args,
                                                        kw, output, nullptr);
    Py_XDECREF(kw);
  }
  at::impl::PythonTorchFunctionTLS::set_disabled_state(old);
  Py_DECREF(key);
  if (done == nullptr) {
    Py_DECREF(output);
    return nullptr;
  }
  Py_DECREF(done);
  return output;
}

int reporter_traverse(Reporter* self, visitproc visit, void* arg) {
  Py_VISIT(self->inner);
  Py_VISIT(self->label);
  Py_VISIT(self->on_output);
  Py_VISIT(self->keys);
  return 0;
}

int reporter_clear(Reporter* self) {
  Py_CLEAR(self->inner);
  Py_CLEAR(self->label);
  Py_CLEAR(self->on_output);
  Py_CLEAR(self->keys);
  return 0;
}

void reporter_dealloc(Reporter* self) {
  PyObject_GC_UnTrack(self);
  reporter_clear(self);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

PyObject* reporter_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *inner, *label, *on_output, *keys;
  if (!PyArg_ParseTuple(args, "OUOO!", &inner, &label, &on_output, &PyDict_Type, &keys))
    return nullptr;
  Reporter* self = (Reporter*)type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  self->inner = (Py_INCREF(inner), inner);
  self->label = (Py_INCREF(label), label);
  self->on_output = (Py_INCREF(on_output), on_output);
  self->keys = (Py_INCREF(keys), keys);
  return (PyObject*)self;
}

PyObject* reporter_get_inner(Reporter* self, void*) {
  Py_INCREF(self->inner);
  return self->inner;
}

PyGetSetDef reporter_getset[] = {
    {"__wrapped__", (getter)reporter_get_inner, nullptr, "the forward it wraps", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject ReporterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---- a CUDA metric batch's table (`_fused_stats.RunReducer.reduce_many`) -------------------------

// `_fused_stats._as_stored`: the kernels read a and b where they are, element k against element
// k in memory: both contiguous, or both dense (no gap, no overlap) with the same strides; never
// a negated view (its memory holds the values' negatives: copied, which applies the sign).
inline bool as_stored(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_neg() || b.is_neg()) return false;
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.strides() == b.strides() && a.is_non_overlapping_and_dense() &&
         b.is_non_overlapping_and_dense();
}

// scan(pairs) -> (groups, strided): the pairs' positions by (dtype_a, dtype_b), in the order the
// dtype pairs first appear (as the Python dict), and the positions of the pairs the kernels
// cannot read where they are (not `as_stored`: what `read_in_place` copies).
PyObject* scan(PyObject*, PyObject* pairs) {
  try {
    if (!PyList_Check(pairs)) {
      PyErr_SetString(PyExc_TypeError, "scan(pairs): a list of (a, b) tensor pairs");
      return nullptr;
    }
    Ref groups(check(PyDict_New()));
    Ref strided(check(PyList_New(0)));
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* pair = PyList_GET_ITEM(pairs, i);
      if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "scan: pair %zd is not an (a, b) pair", i);
        return nullptr;
      }
      PyObject* a = PySequence_Fast_GET_ITEM(pair, 0);
      PyObject* b = PySequence_Fast_GET_ITEM(pair, 1);
      if (!is_tensor(a) || !is_tensor(b)) {
        PyErr_Format(PyExc_TypeError, "scan: pair %zd holds a non-tensor", i);
        return nullptr;
      }
      Ref dtype_a(check(PyObject_GetAttr(a, s.dtype)));
      Ref dtype_b(check(PyObject_GetAttr(b, s.dtype)));
      Ref key(check(PyTuple_Pack(2, dtype_a.get(), dtype_b.get())));
      Ref index(check(PyLong_FromSsize_t(i)));
      PyObject* members = PyDict_GetItemWithError(groups.get(), key.get());
      if (members == nullptr) {
        if (PyErr_Occurred()) return nullptr;
        Ref fresh(check(PyList_New(0)));
        check_rc(PyDict_SetItem(groups.get(), key.get(), fresh.get()));
        members = fresh.get();
      }
      check_rc(PyList_Append(members, index.get()));
      if (!as_stored(unpack(a), unpack(b)))
        check_rc(PyList_Append(strided.get(), index.get()));
    }
    return check(PyTuple_Pack(2, groups.get(), strided.get()));
  } catch (const PyFailed&) {
    return nullptr;
  } catch (const std::exception& err) {
    set_error(err);
    return nullptr;
  }
}

inline int64_t floor_div(int64_t x, int64_t y) {
  int64_t q = x / y;
  return (x % y != 0 && ((x < 0) != (y < 0))) ? q - 1 : q;
}

// table(flats, index, tile, programs, origin_a, origin_b, size_a, size_b)
//   -> (meta bytes, owners bytes, programs in all, misaligned)
// One dtype pair's launch table, as `RunReducer._plan` lays it out: five int64s a pair (element
// offsets of a and b from the group's bases, numel, grid = min(tiles, programs), first
// program), the pair each program belongs to (int32 a program), the programs in all, and the
// low four address bits of every a or'ed together, every b's above them.
PyObject* table(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "table(flats, index, tile, programs, origin_a, origin_b, size_a, size_b)");
    return nullptr;
  }
  try {
    PyObject* flats = args[0];
    PyObject* index = args[1];
    int64_t tile = as_int(args[2]), programs = as_int(args[3]);
    int64_t origin_a = as_int(args[4]), origin_b = as_int(args[5]);
    int64_t size_a = as_int(args[6]), size_b = as_int(args[7]);
    if (tile <= 0 || programs <= 0 || size_a <= 0 || size_b <= 0) {
      PyErr_SetString(PyExc_ValueError, "table: tile, programs and sizes must be positive");
      return nullptr;
    }
    Py_ssize_t count = PyList_GET_SIZE(index);
    std::string meta(sizeof(int64_t) * 5 * count, '\0');
    int64_t* row = reinterpret_cast<int64_t*>(meta.data());
    // One int32 a program: filled a pair at a time (a big pair has a thousand programs; sd3
    // full's batches tens of thousands).
    std::vector<int32_t> owners;
    int64_t first = 0, misaligned = 0;
    Py_ssize_t flat_count = PyList_GET_SIZE(flats);
    for (Py_ssize_t k = 0; k < count; ++k) {
      Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(index, k));
      if (i == -1 && PyErr_Occurred()) return nullptr;
      if (i < 0 || i >= flat_count) {
        PyErr_Format(PyExc_IndexError, "table: index %zd out of the batch", i);
        return nullptr;
      }
      PyObject* pair = PyList_GET_ITEM(flats, i);
      if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "table: flat %zd is not an (a, b) pair", i);
        return nullptr;
      }
      const at::Tensor& fa = unpack(PySequence_Fast_GET_ITEM(pair, 0));
      const at::Tensor& fb = unpack(PySequence_Fast_GET_ITEM(pair, 1));
      int64_t n = fa.numel();
      int64_t grid = std::min((n + tile - 1) / tile, programs);
      int64_t address_a = (int64_t)(intptr_t)fa.data_ptr();
      int64_t address_b = (int64_t)(intptr_t)fb.data_ptr();
      misaligned |= (address_a & 15) | ((address_b & 15) << 4);
      row[0] = floor_div(address_a - origin_a, size_a);
      row[1] = floor_div(address_b - origin_b, size_b);
      row[2] = n;
      row[3] = grid;
      row[4] = first;
      row += 5;
      owners.insert(owners.end(), (size_t)grid, (int32_t)k);
      first += grid;
    }
    Ref meta_bytes(check(PyBytes_FromStringAndSize(meta.data(), (Py_ssize_t)meta.size())));
    Ref owner_bytes(check(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(owners.data()),
                                                    (Py_ssize_t)(owners.size() * sizeof(int32_t)))));
    Ref first_obj(check(PyLong_FromLongLong(first)));
    Ref misaligned_obj(check(PyLong_FromLongLong(misaligned)));
    return check(PyTuple_Pack(4, meta_bytes.get(), owner_bytes.get(), first_obj.get(),
                              misaligned_obj.get()));
  } catch (const PyFailed&) {
    return nullptr;
  } catch (const std::exception& err) {
    set_error(err);
    return nullptr;
  }
}

// ---- a batch's non-contiguous tensors, copied a few kernels a batch ------------------------------

// `tensor.view(-1, last dim)` where its leading dimensions merge (`_fused_stats._rows_view`): each
// non-trivial one's stride is the next non-trivial inner one's stride times its size.
bool rows_view(const at::Tensor& t, at::Tensor& out) {
  auto sizes = t.sizes();
  auto strides = t.strides();
  bool have = false;
  int64_t expected = 0;
  for (int64_t dim = t.dim() - 2; dim >= 0; --dim) {
    if (sizes[dim] == 1) continue;
    if (have && strides[dim] != expected) return false;
    expected = strides[dim] * sizes[dim];
    have = true;
  }
  try {
    out = t.detach().view({-1, sizes[t.dim() - 1]});
  } catch (const c10::Error&) { // not expected after the check above; copied instead
    return false;
  }
  return true;
}

// `_fused_stats._bits`: bf16 as its int16 bits, any other dtype as it is.
inline at::Tensor bits(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kShort) : t;
}

// read_in_place(pairs) -> (flats, read): `_fused_stats._read_in_place`, the same copies in the
// same order (one cat per dtype and row length, one stack per dtype and shape, the rest one by
// one), the same flats and the same `read` list.
// Torch's own error translation (`HANDLE_TH_ERRORS`): its copies allocate, and an out-of-memory
// error stays a `torch.OutOfMemoryError`, as `torch.cat` raises it.
PyObject* read_in_place(PyObject*, PyObject* pairs) {
  HANDLE_TH_ERRORS
  try {
    if (!PyList_Check(pairs)) {
      PyErr_SetString(PyExc_TypeError, "read_in_place(pairs): a list of (a, b) tensor pairs");
      return nullptr;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    // flats[i][j]: the original object (borrowed from `pairs`) or a new tensor.
    struct Slot {
      PyObject* original = nullptr;
      at::Tensor made;
      bool is_made = false;
    };
    std::vector<std::array<Slot, 2>> flats((size_t)n);
    struct Member {
      Py_ssize_t i;
      int j;
      at::Tensor tensor;
    };
    struct Rows {
      at::ScalarType dtype;
      int64_t width;
      std::vector<Member> members;
    };
    struct Alike {
      at::ScalarType dtype;
      std::vector<int64_t> shape;
      std::vector<Member> members;
    };
    std::vector<Rows> rows;
    std::vector<Alike> alike;
    Ref read(check(PyList_New(0)));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* pair = PyList_GET_ITEM(pairs, i);
      if (!(PyTuple_Check(pair) || PyList_Check(pair)) || PySequence_Fast_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "read_in_place: pair %zd is not an (a, b) pair", i);
        return nullptr;
      }
      for (int j = 0; j < 2; ++j) {
        PyObject* obj = PySequence_Fast_GET_ITEM(pair, j);
        if (!is_tensor(obj)) {
          PyErr_Format(PyExc_TypeError, "read_in_place: pair %zd holds a non-tensor", i);
          return nullptr;
        }
        flats[i][j].original = obj;
        const at::Tensor& t = unpack(obj);
        if (t.is_contiguous() && !t.is_neg()) {
          check_rc(PyList_Append(read.get(), obj));
          continue;
        }
        int64_t size = (int64_t)t.element_size();
        int64_t width = t.dim() ? t.size(-1) : 0;
        if (width && (width * size) % 16 == 0) {
          at::Tensor view;
          if (rows_view(t, view)) {
            auto it = std::find_if(rows.begin(), rows.end(), [&](const Rows& r) {
              return r.dtype == t.scalar_type() && r.width == width;
            });
            if (it == rows.end()) {
              rows.push_back({t.scalar_type(), width, {}});
              it = rows.end() - 1;
            }
            it->members.push_back({i, j, std::move(view)});
            continue;
          }
        }
        if ((t.numel() * size) % 16 == 0) {
          std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
          auto it = std::find_if(alike.begin(), alike.end(), [&](const Alike& r) {
            return r.dtype == t.scalar_type() && r.shape == shape;
          });
          if (it == alike.end()) {
            alike.push_back({t.scalar_type(), std::move(shape), {}});
            it = alike.end() - 1;
          }
          it->members.push_back({i, j, t.detach()});
          continue;
        }
        at::Tensor copy = bits(t.detach().reshape({-1}).contiguous().resolve_neg());
        flats[i][j].made = copy;
        flats[i][j].is_made = true;
        Ref wrapped(check(THPVariable_Wrap(copy)));
        check_rc(PyList_Append(read.get(), wrapped.get()));
      }
    }
    for (Rows& group : rows) {
      std::vector<at::Tensor> views;
      views.reserve(group.members.size());
      for (const Member& m : group.members) views.push_back(m.tensor);
      at::Tensor flat = at::cat(views).view({-1});
      Ref wrapped(check(THPVariable_Wrap(flat)));
      check_rc(PyList_Append(read.get(), wrapped.get()));
      int64_t start = 0;
      for (const Member& m : group.members) {
        int64_t count = m.tensor.numel();
        flats[m.i][m.j].made = flat.slice(0, start, start + count);
        flats[m.i][m.j].is_made = true;
        start += count;
      }
    }
    for (Alike& group : alike) {
      std::vector<at::Tensor> tensors;
      tensors.reserve(group.members.size());
      for (const Member& m : group.members) tensors.push_back(m.tensor);
      // Into a contiguous buffer, as `_read_in_place`: `stack` keeps its inputs' memory format
      // (channels-last ones would leave no flat view).
      std::vector<int64_t> sizes{(int64_t)tensors.size()};
      sizes.insert(sizes.end(), group.shape.begin(), group.shape.end());
      at::Tensor stacked = at::empty(sizes, tensors.front().options());
      at::stack_out(stacked, tensors);
      Ref wrapped(check(THPVariable_Wrap(stacked)));
      check_rc(PyList_Append(read.get(), wrapped.get()));
      at::Tensor flat = stacked.view({(int64_t)group.members.size(), -1});
      int64_t k = 0;
      for (const Member& m : group.members) {
        flats[m.i][m.j].made = flat.select(0, k++);
        flats[m.i][m.j].is_made = true;
      }
    }
    Ref out(check(PyList_New(n)));
    for (Py_ssize_t i = 0; i < n; ++i) {
      Ref pair(check(PyTuple_New(2)));
      for (int j = 0; j < 2; ++j) {
        Slot& slot = flats[i][j];
        PyObject* item;
        if (slot.is_made) {
          item = check(THPVariable_Wrap(slot.made));
        } else {
          Py_INCREF(slot.original);
          item = slot.original;
        }
        PyTuple_SET_ITEM(pair.get(), j, item);
      }
      PyList_SET_ITEM(out.get(), i, pair.release());
    }
    return check(PyTuple_Pack(2, out.get(), read.get()));
  } catch (const PyFailed&) {
    return nullptr;
  }
  END_HANDLE_TH_ERRORS
}

// ---- module ---------------------------------------------------------------------------------------

// setup(Tensor, _Pending, Skipped, defer_numel, flush_numel, device_pairs, device_batch_numel)
PyObject* setup(PyObject*, PyObject* args) {
  PyObject *tensor, *pending, *skipped;
  long long defer, flush, pairs, batch;
  if (!PyArg_ParseTuple(args, "O!O!O!LLLL", &PyType_Type, &tensor, &PyType_Type, &pending,
                        &PyType_Type, &skipped, &defer, &flush, &pairs, &batch))
    return nullptr;
  const char* fields[kPendingFields] = {"order", "module", "call", "output", "module_class",
                                        "dtype_a", "dtype_b", "shape", "stats", "hist",
                                        "same_as"};
  PyMemberDef* members = ((PyTypeObject*)pending)->tp_members;
  for (int f = 0; f < kPendingFields; ++f) {
    Py_ssize_t at = -1;
    for (PyMemberDef* m = members; m != nullptr && m->name != nullptr; ++m) {
      if (std::string(m->name) == fields[f] && m->type == T_OBJECT_EX) at = m->offset;
    }
    if (at < 0) {
      PyErr_Format(PyExc_TypeError, "setup: _Pending has no object slot %s", fields[f]);
      return nullptr;
    }
    g_pending_at[f] = at;
  }
  Py_XSETREF(g_tensor, (Py_INCREF(tensor), tensor));
  Py_XSETREF(g_pending, (Py_INCREF(pending), pending));
  Py_XSETREF(g_skipped, (Py_INCREF(skipped), skipped));
  g_defer_numel = defer;
  g_flush_numel = flush;
  g_device_pairs = pairs;
  g_device_batch_numel = batch;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"scan", (PyCFunction)scan, METH_O,
     "scan(pairs) -> ({(dtype_a, dtype_b): [position, ...]}, [strided position, ...])"},
    {"table", (PyCFunction)(void (*)(void))table, METH_FASTCALL,
     "table(flats, index, tile, programs, origin_a, origin_b, size_a, size_b) -> (meta bytes, "
     "owners bytes, programs, misaligned)"},
    {"read_in_place", (PyCFunction)read_in_place, METH_O,
     "read_in_place(pairs) -> (flats, read): `_fused_stats._read_in_place` in C++"},
    {"setup", (PyCFunction)setup, METH_VARARGS,
     "setup(Tensor, _Pending, Skipped, defer_numel, flush_numel, device_pairs, "
     "device_batch_numel)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_pair_core",
                          "The lockstep pair's per-output path (lab/pairing/pair_core.py).", -1,
                          module_methods};

} // namespace

PyMODINIT_FUNC PyInit__pair_core(void) {
  if (!intern_names()) return nullptr;
  g_question = PyUnicode_InternFromString("?");
  g_empty = PyUnicode_InternFromString("");
  if (g_question == nullptr || g_empty == nullptr) return nullptr;
  for (int i = 0; i < 64; ++i) {
    g_idx[i] = PyUnicode_FromFormat("%d", i);
    if (g_idx[i] == nullptr) return nullptr;
  }

  LockstepType.tp_name = "_pair_core.Lockstep";
  LockstepType.tp_basicsize = sizeof(Lockstep);
  LockstepType.tp_vectorcall_offset = offsetof(Lockstep, vectorcall);
  LockstepType.tp_flags =
      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  LockstepType.tp_doc = "_Lockstep._on_output's common case (see lab/pairing/pair_core.py)";
  LockstepType.tp_new = lockstep_new;
  LockstepType.tp_call = lockstep_tp_call;
  LockstepType.tp_dealloc = (destructor)lockstep_dealloc;
  LockstepType.tp_traverse = (traverseproc)lockstep_traverse;
  LockstepType.tp_clear = (inquiry)lockstep_clear;
  LockstepType.tp_methods = lockstep_methods;
  if (PyType_Ready(&LockstepType) < 0) return nullptr;

  ReporterType.tp_name = "_pair_core.Reporter";
  ReporterType.tp_basicsize = sizeof(Reporter);
  ReporterType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  ReporterType.tp_doc = "A captured module's forward that reports its output (Reporter(inner, "
                        "label, on_output, keys))";
  ReporterType.tp_new = reporter_new;
  ReporterType.tp_call = reporter_call;
  ReporterType.tp_dealloc = (destructor)reporter_dealloc;
  ReporterType.tp_traverse = (traverseproc)reporter_traverse;
  ReporterType.tp_clear = (inquiry)reporter_clear;
  ReporterType.tp_getset = reporter_getset;
  if (PyType_Ready(&ReporterType) < 0) return nullptr;

  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&LockstepType);
  Py_INCREF(&ReporterType);
  if (PyModule_AddObject(m, "Lockstep", (PyObject*)&LockstepType) < 0 ||
      PyModule_AddObject(m, "Reporter", (PyObject*)&ReporterType) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
