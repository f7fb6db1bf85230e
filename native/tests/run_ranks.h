// Runtimes (or bare Gloo communicators) as threads of one process, for the
// C++ tests that need peers.
#pragma once

#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_comm.h"
#include "core/runtime.h"

namespace sdl {

// Runs body(rank, runtime) on n runtimes, each built and destroyed on its own
// thread (construction blocks until the peers meet). transport: "shm" (one
// host) or "gloo" (a host identity per rank forces TCP over loopback).
// configure, when given, adjusts each rank's config before its runtime starts;
// options, each rank's options (options(rank, o)).
inline void RunRanks(int n, const std::string& transport,
                     const std::function<void(int, Runtime&)>& body,
                     const std::function<void(Config&)>& configure = {},
                     const std::function<void(int, RuntimeOptions&)>& options = {}) {
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
      if (options) options(r, o);
      Runtime rt(std::move(o));
      EXPECT_EQ(rt.TransportOf(0), transport);
      body(r, rt);
    });
  }
  for (auto& t : threads) t.join();
}

// Runs body(member, comm) on n Gloo communicators over the loopback, each
// built and destroyed on its own thread. An exception in a member fails the
// test naming the member (and ends that member, so its peers fail too).
inline void RunGlooMembers(int n, const std::function<void(int, GlooComm&)>& body) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::vector<int> ranks(n);
        for (int q = 0; q < n; ++q) ranks[q] = q;
        GlooComm comm(MakeGlooDevice("", "127.0.0.1"), *store, r, n, ranks, 60, 60);
        body(r, comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "member " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace sdl
