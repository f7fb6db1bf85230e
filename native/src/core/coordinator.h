// The coordinator's half of negotiation (runs on member 0 of a process set).
//
// Steps c) and d) of the negotiation protocol described in core/controller.h:
// the table of requests per name, validation across members, groups, fusion.
#pragma once

#include <string>
#include <vector>

#include "common/message.h"
#include "core/process_set.h"

namespace sdl {

// Adds member's requests (and its joined state) to the set's table.
void CoordinatorAdd(ProcessSet& ps, int member, std::vector<Request> reqs, bool joined);

// The stall inspector's settings (knobs stall_check_s, stall_shutdown_s,
// stall_check_disable) and what its messages name.
struct StallOptions {
  double check_s = 0;     // warn about names waiting longer (0: never)
  double shutdown_s = 0;  // fail names waiting longer, ending the runtime (0: never)
  // Global rank -> host name, for the messages (null or short: ranks only).
  const std::vector<std::string>* hosts = nullptr;
};

// Removes and returns every ready name as a validated response, fused.
//
// The stall inspector: while some names have waited longer than stall.check_s
// for members that have not submitted them, one warning per check period
// (stall.check_s) goes to *warnings, naming those names grouped by the
// members missing from them, with their hosts (bounded length). A name that
// has waited longer than stall.shutdown_s (> 0) ends the runtime on every
// member: one error response of code kPeerFailure naming the stalled names
// and the missing members (Runtime::Execute throws it, so every member stops
// in the same cycle and the flight recorders dump).
//
// A name that cannot complete fails with a kMismatch response once it has waited
// longer than mismatch_s (> 0) and every member missing from it has itself waited
// that long on other names (a rank that is alive but submits different
// collectives, e.g. after its script raised and moved on): the error names the
// tensor and the names those members wait on; the runtime stays usable. A
// silent member is not such a case: the stall inspector warns about it, the
// stall shutdown ends it, and its peers' communicator timeout reports a hang
// in a transport.
std::vector<Response> CoordinatorReady(ProcessSet& ps, int64_t fusion_threshold,
                                       const StallOptions& stall, double mismatch_s,
                                       std::vector<std::string>* warnings);

// Where the members parted ways, from the coordinator's table (so it works
// when a peer is dead): the oldest name some members submitted and others did
// not, e.g. "allreduce 'x' submitted by rank 0, not by rank 1 (host h1)", with
// how many more names wait; "" when nothing waits.
std::string CoordinatorDivergence(const ProcessSet& ps, const std::vector<std::string>* hosts);

// Appends a copy of the cached single-name response r to out, except that a
// member of a grouped allreduce joins its group's response there instead (one
// per group, dtype and device, as in the negotiation's group merge); groups
// holds the indices in out of the group responses so far. Members cost a name
// and a shape each, not a whole response.
void AppendMerged(std::vector<Response>* out, std::vector<size_t>* groups, const Response& r);

// Merges cached single-name responses of the same group into one response.
std::vector<Response> MergeGroups(const std::vector<Response>& ready);

}  // namespace sdl
