// The Python module of the CPU kernels: one extension built from every .cpp here. (Only
// this file includes pybind11, through torch's tensor casters: torch/extension.h, the
// whole C++ frontend, took 47 s a file to compile on a Zen 1.)
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace py = pybind11;

// The long kernels (a decode batch's attention, the LM head, a linear: 0.5-20 ms) run
// without the GIL, so the scheduler's round (HTTP streams included) can run beside them;
// the row ops (a few microseconds) keep it: a GIL hand-over there costs more than the op.
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      // keep_alive: the stack holds `comm` (argument 10; 1 is the stack) as long as it lives
      .def(py::init<const std::vector<at::Tensor>&, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double,
                    int64_t, ShmComm*, double>(),
           py::arg("per_layer"), py::arg("final_norm"), py::arg("cos_sin_cache"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"), py::arg("dense_min_rows"),
           py::arg("comm") = py::none(), py::arg("comm_timeout_s") = 0.0, py::keep_alive<1, 11>())
      .def("forward", &DecodeStack::forward, py::arg("h"), py::arg("positions"), py::arg("loc"), py::arg("kv_idx"),
           py::arg("lens"), py::arg("token_req") = py::none(), release_gil());
  m.def("paged_attention", &paged_attention, "paged attention, one query token at a time (CPU)", release_gil());
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", release_gil());
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; weight * rms_norm(residual)");
  m.def("rotary_", &rotary_, "RoPE on the first heads of each row, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("cast", &cast, "x.to(dtype) on the kernels' threads");
  m.def("argmax_rows", &argmax_rows, "logits.argmax(-1) of float32 rows (first maximum; NaN wins)");
  m.def("store_kv", &store_kv, "k_buf[loc] = k, v_buf[loc] = v (cast to the buffers' dtype); round_src: k, v = what they hold",
        py::arg("k_buf"), py::arg("v_buf"), py::arg("loc"), py::arg("k"), py::arg("v"), py::arg("round_src") = false);
  m.def("q4_linear_isa", &q4_linear_isa, "what q4_linear runs on: avx512-vnni, avx2, or empty (a scalar loop)");
  m.def("q4_linear", &q4_linear, "x @ W.T with W in Q4 blocks, x in int8 blocks of 32", release_gil());
  m.def("q8_linear_vnni", &q8_linear_vnni, "x @ W.T with W in Q8 blocks (pack_q8_vnni), x in int8 blocks of 32",
        release_gil());
  m.def("f32_linear_isa", &f32_linear_isa, "what f32_linear runs on: avx2, or empty (a scalar loop; oneDNN is faster)");
  m.def("f32_linear", &f32_linear, "x @ W.T in float32 (W: pack_f32_panels, or pack_q4 / pack_q8_vnni records dequantized as it goes)", release_gil());
  m.def("bf16_linear_isas", &bf16_linear_isas,
        "where bf16_linear runs here, best first: amx-bf16 (tile state granted), avx512-bf16; empty: nowhere");
  m.def("bf16_linear", &bf16_linear, "x @ W.T in float32 from bf16 operands (W: pack_bf16_tiles)", py::arg("x"),
        py::arg("packed"), py::arg("isa") = "", release_gil());
  m.def("bf16_linear_silu_mul", &bf16_linear_silu_mul, "silu(gate) * up from a gate|up layer's bf16_linear tiles",
        py::arg("x"), py::arg("packed"), py::arg("isa") = "", release_gil());
  m.def("q8_linear", &q8_linear, "x @ W.T with W in int8 blocks of 32", release_gil());
  // The collectives wait on other processes: without the GIL, as gloo's do.
  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init<at::Tensor, int64_t, int64_t, int64_t, std::vector<int64_t>, std::vector<int64_t>, double>(),
           py::arg("segment"), py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("pids"),
           py::arg("start_times"), py::arg("spin_us"))
      .def_static("segment_bytes", &ShmComm::segment_bytes, py::arg("world"), py::arg("slot_bytes"))
      .def("all_reduce_", &ShmComm::all_reduce_, py::arg("x"), py::arg("timeout_s"), release_gil())
      .def("all_gather", &ShmComm::all_gather, py::arg("x"), py::arg("timeout_s"), release_gil())
      .def("broadcast_", &ShmComm::broadcast_, py::arg("x"), py::arg("root"), py::arg("timeout_s"), release_gil());
}
