// Channel planes gathered: y[n, c] = x[n, planes[c]] for arrays (N, C, ...)
// of the same trailing axes. ShuffleNetV2's channel shuffle and split (a
// reshape, a transpose, a reshape, a slice over channels) pick whole planes
// of their input in a new order. XLA copies them in a loop fusion that it
// splits over its own thread pool at 28x28; the run then resumed on a pool
// thread while the calling thread stayed busy, and in 14-30% of
// ShuffleNetV2's runs the kernels' helper got no core (2.1 ms against 1.5).
// Here the copy is a call like any other kernel's: the caller and the crew
// (kernels/crew.cc) each copy whole planes.
#include <cstring>

#include "common.h"

namespace jtile {
namespace {

ffi::Error GatherPlanes(ffi::ThreadPool pool, F32Buffer x, ffi::Span<const int64_t> planes, F32Result y) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() < 2 || xd.size() != yd.size() || xd[0] != yd[0] || yd[1] != (int64_t)planes.size() ||
      !std::equal(xd.begin() + 2, xd.end(), yd.begin() + 2))
    return ffi::Error::InvalidArgument(
        "jtile gather_planes: y must have shape (N, len(planes), *x.shape[2:]) for x of shape (N, C, ...)");
  const int64_t images = xd[0], channels = xd[1], picked = yd[1];
  for (int64_t p : planes)
    if (p < 0 || p >= channels)
      return ffi::Error::InvalidArgument("jtile gather_planes: a plane index is outside x's channels");
  int64_t plane = 1;
  for (size_t ax = 2; ax < xd.size(); ++ax) plane *= xd[ax];
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const int64_t count = images * picked;
  const int64_t per_task = std::max<int64_t>(1, (int64_t(16) << 10) / std::max<int64_t>(plane, 1));  // ~64 KB
  parallel_for(pool, ceil_div(count, per_task), [&](int64_t task) {
    for (int64_t i = task * per_task; i < std::min(count, (task + 1) * per_task); ++i)
      std::memcpy(ys + i * plane, xs + (i / picked * channels + planes[i % picked]) * plane, plane * sizeof(float));
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileGatherPlanes, jtile::GatherPlanes,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<xla::ffi::Span<const int64_t>>("planes")
                         .Ret<jtile::F32Buffer>());
