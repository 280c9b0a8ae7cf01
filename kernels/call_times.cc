// Per-call wall time of every kernel handler, recorded while enabled
// (jtile.kernels.call_times): the time inside the handler, from its first
// instruction to its return, as XLA runs it inside a model. Unlike a
// profiler's trace, it adds nothing measurable to a call (a clock read at each
// end), so calls of tens of microseconds are timed as they run.
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace jtile::timing {

std::atomic<bool> enabled{false};

namespace {

std::mutex mutex;
std::string records;  // "symbol\tinput dims\toutput dims\tmicroseconds\n" per call

void append_dims(std::string& out, const XLA_FFI_Buffer* b) {
  for (int64_t d = 0; d < b->rank; ++d) {
    if (d > 0) out += ',';
    out += std::to_string(b->dims[d]);
  }
}

}  // namespace

void record(const char* symbol, const XLA_FFI_CallFrame* frame, std::chrono::steady_clock::time_point start) {
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  std::string line = symbol;
  line += '\t';
  if (frame->args.size > 0 && frame->args.types[0] == XLA_FFI_ArgType_BUFFER)
    append_dims(line, static_cast<const XLA_FFI_Buffer*>(frame->args.args[0]));
  line += '\t';
  if (frame->rets.size > 0 && frame->rets.types[0] == XLA_FFI_RetType_BUFFER)
    append_dims(line, static_cast<const XLA_FFI_Buffer*>(frame->rets.rets[0]));
  line += '\t' + std::to_string(us) + '\n';
  std::lock_guard<std::mutex> lock(mutex);
  records += line;
}

}  // namespace jtile::timing

// Starts (1) or stops (0) recording.
extern "C" void JtileCallTimesEnable(int64_t on) { jtile::timing::enabled.store(on != 0); }

// Copies the records made so far into buf and forgets them, if they fit in
// `size` bytes; returns their size either way (so a call with size 0 asks for it).
extern "C" int64_t JtileCallTimesTake(char* buf, int64_t size) {
  std::lock_guard<std::mutex> lock(jtile::timing::mutex);
  const int64_t n = (int64_t)jtile::timing::records.size();
  if (n <= size) {
    std::memcpy(buf, jtile::timing::records.data(), n);
    jtile::timing::records.clear();
  }
  return n;
}
