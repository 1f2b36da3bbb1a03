// CPU stand-ins for csrc/cuda_utils.cpp and csrc/graph_timer/graph_timer_cuda.cpp: device memory is
// host memory, the "stream" is 0 and an async copy is a memcpy (the callers, scheduler.hpp:1273-1297,
// copy state slots and KV blocks inside one buffer). CUDA IPC and CUDA graphs do not exist on a CPU:
// those entry points raise.
#include "cuda_utils.hpp"

#include <chrono>
#include <cstring>
#include <functional>

#include "graph_timer/graph_timer.hpp"

namespace deepinfer::cuda::utils {

std::optional<torch::Tensor> alloc_tensor(ssize_t size) {
    return {torch::zeros({size}, at::TensorOptions().device(torch::kCPU).dtype(torch::kByte))};
}

std::optional<torch::Tensor> import_ipc_tensor(py::bytes) { TORCH_CHECK(false, "CUDA IPC is not available on the CPU build"); }

py::bytes export_ipc_tensor(size_t, ssize_t) { TORCH_CHECK(false, "CUDA IPC is not available on the CPU build"); }

void cuda_copy_async(void *dst, void *src, size_t size, uint64_t) { std::memmove(dst, src, size); }

uint64_t get_current_stream() { return 0; }

void pymodule_init(pybind11::module &m) {
    m.def("alloc_tensor", &alloc_tensor, py::arg("size"))
        .def("export_ipc_tensor", &export_ipc_tensor, py::arg("ptr"), py::arg("nbytes"))
        .def("import_ipc_tensor", &import_ipc_tensor, py::arg("data"));
}

} // namespace deepinfer::cuda::utils

namespace deepinfer::graph_timer {

static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// An event is a heap cell holding the time it was recorded at.
EventHandle::EventHandle() : raw_event_(reinterpret_cast<int64_t>(new int64_t(0))) {}
EventHandle::EventHandle(int64_t raw_event) : raw_event_(raw_event) {}
void EventHandle::record(int64_t, bool) const { *reinterpret_cast<int64_t *>(raw_event_) = now_ns(); }
void EventHandle::synchronize() const {}
bool EventHandle::query() const { return true; }
float EventHandle::elapsed_time(const EventHandle &end_event) const {
    return static_cast<float>(*reinterpret_cast<int64_t *>(end_event.raw_event_) - *reinterpret_cast<int64_t *>(raw_event_)) / 1e6f;
}
bool EventHandle::operator==(const EventHandle &other) const { return raw_event_ == other.raw_event_; }
std::size_t EventHandle::hash() const { return std::hash<int64_t>{}(raw_event_); }

EventRecordNodeHandle::EventRecordNodeHandle(int64_t raw_node, int64_t raw_graph_exec) : raw_node_(raw_node), raw_graph_exec_(raw_graph_exec) {}
EventHandle EventRecordNodeHandle::get_event() const { TORCH_CHECK(false, "CUDA graphs are not available on the CPU build"); }
void EventRecordNodeHandle::set_event(const EventHandle &) { TORCH_CHECK(false, "CUDA graphs are not available on the CPU build"); }

GraphHandle::GraphHandle(py::object graph) : graph_(std::move(graph)) { TORCH_CHECK(false, "CUDA graphs are not available on the CPU build"); }
std::vector<EventRecordNodeHandle> GraphHandle::get_event_record_nodes() const { return {}; }
bool GraphHandle::operator==(const GraphHandle &other) const { return raw_graph_exec_ == other.raw_graph_exec_; }
std::size_t GraphHandle::hash() const { return std::hash<int64_t>{}(raw_graph_exec_); }

} // namespace deepinfer::graph_timer
