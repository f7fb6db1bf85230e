// DeviceGuard over a fake CUDA runtime and driver (no GPU needed): which device
// a thread is left on, and that no context is created on a device the thread
// never used (cudaSetDevice initializes a primary context since CUDA 12).
#include <gtest/gtest.h>

#ifdef SDL_HAVE_CUDA

#include <set>
#include <thread>

#include "gpu/cuda_api.h"

namespace sdl {
namespace gpu {
namespace {

// Per thread: the current device (0 before any choice, as CUDA says); per
// process: the devices whose primary context was initialized.
thread_local int g_current = 0;
std::set<int> g_contexts;

cudaError_t FakeGetDevice(int* d) {
  *d = g_current;
  return cudaSuccess;
}
cudaError_t FakeSetDevice(int d) {
  g_current = d;
  g_contexts.insert(d);
  return cudaSuccess;
}
int FakeDeviceGet(int* dev, int ordinal) {
  *dev = ordinal;
  return 0;
}
int FakeCtxState(int dev, unsigned int* flags, int* active) {
  *flags = 0;
  *active = g_contexts.count(dev) ? 1 : 0;
  return 0;
}

CudaApi FakeApi(bool driver) {
  CudaApi api;
  api.GetDevice = FakeGetDevice;
  api.SetDevice = FakeSetDevice;
  if (driver) {
    api.DriverDeviceGet = FakeDeviceGet;
    api.DriverPrimaryCtxGetState = FakeCtxState;
  }
  return api;
}

// Runs f on a fresh thread (current device 0, as on the core's background thread).
template <typename F> void OnFreshThread(F f) {
  std::thread t(f);
  t.join();
}

TEST(DeviceGuard, AThreadThatNeverChoseADeviceIsLeftOnTheGuardsDevice) {
  g_contexts.clear();
  const CudaApi api = FakeApi(true);
  OnFreshThread([&] {
    {
      DeviceGuard g(&api, 1);
      ASSERT_TRUE(g.status().ok());
      EXPECT_EQ(g_current, 1);
    }
    EXPECT_EQ(g_current, 1) << "0 was never this thread's: setting it back creates a context";
    {
      DeviceGuard g(&api, 1);  // nothing to switch now
    }
  });
  EXPECT_EQ(g_contexts, (std::set<int>{1})) << "no context on GPU 0";
}

TEST(DeviceGuard, AThreadsOwnDeviceIsRestored) {
  g_contexts.clear();
  const CudaApi api = FakeApi(true);
  OnFreshThread([&] {
    FakeSetDevice(2);  // the framework's choice (torch.cuda.set_device(2))
    {
      DeviceGuard g(&api, 1);
      EXPECT_EQ(g_current, 1);
    }
    EXPECT_EQ(g_current, 2);
  });
  EXPECT_EQ(g_contexts, (std::set<int>{1, 2}));
}

TEST(DeviceGuard, WithoutTheDriverSymbolsThePreviousDeviceIsRestored) {
  g_contexts.clear();
  const CudaApi api = FakeApi(false);
  OnFreshThread([&] {
    {
      DeviceGuard g(&api, 1);
    }
    EXPECT_EQ(g_current, 0);
  });
}

}  // namespace
}  // namespace gpu
}  // namespace sdl

#endif  // SDL_HAVE_CUDA
