// Runtimes as threads of one process, for the C++ tests that need peers.
#pragma once

#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/runtime.h"

namespace sdl {

// Runs body(rank, runtime) on n runtimes, each built and destroyed on its own
// thread (construction blocks until the peers meet). transport: "shm" (one
// host) or "gloo" (a host identity per rank forces TCP over loopback).
// configure, when given, adjusts each rank's config before its runtime starts.
inline void RunRanks(int n, const std::string& transport,
                     const std::function<void(int, Runtime&)>& body,
                     const std::function<void(Config&)>& configure = {}) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      RuntimeOptions o;
      o.topo = {r, n, r, n, 0, 1};
      o.hostname = "127.0.0.1";
      o.store = store;
      o.config.timeout_s = 20;
      o.config.start_timeout_s = 20;
      if (transport == "gloo") o.config.host_id = "host" + std::to_string(r);
      if (configure) configure(o.config);
      Runtime rt(std::move(o));
      EXPECT_EQ(rt.TransportOf(0), transport);
      body(r, rt);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace sdl
