// A minimal parallel-for for the CPU backend: tasks [0, n) handed out one at a time from an
// atomic counter to hardware_concurrency() threads (MSA_CPU_THREADS overrides). Each task is a
// deterministic unit of work, so results never depend on the thread count or schedule. Where
// the system gives fewer threads than asked, the calling thread and those it got share the tasks.
#pragma once

#include <cstdint>
#include <functional>

namespace msa::cpu {

int num_threads();

// Calls fn(task, worker) for every task in [0, n); `worker` is in [0, num_threads()).
void parallel_for(int64_t n, const std::function<void(int64_t task, int worker)>& fn);

}  // namespace msa::cpu
