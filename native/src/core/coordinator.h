// The coordinator's half of negotiation (runs on member 0 of a process set).
//
// Protocol, per cycle and per process set (see Runtime::Cycle):
//  a) every member ANDs a bit vector: one bit per response-cache slot whose
//     tensor it has ready, plus inverted flags (needs full negotiation,
//     shutdown, coordinator has pending names, joined). Slots set on every
//     member run at once from the cache: no further messages.
//  b) if any flag asks for it, every member sends the requests it has not sent
//     yet to the coordinator (an allgather of encoded request lists);
//  c) the coordinator adds them to its table; a name is ready when every
//     member asked for it (joined members count as ready for allreduce);
//  d) ready names are validated across members (op, dtype, shape, root, ...)
//     into responses (or error responses naming the ranks and what differed),
//     grouped allreduces wait for their whole group, and compatible
//     allreduces are fused up to the fusion threshold;
//  e) the coordinator broadcasts the response list and every member executes
//     it in order, so collectives run in the same order everywhere.
#pragma once

#include <vector>

#include "common/message.h"
#include "core/process_set.h"

namespace sdl {

// Adds member's requests (and its joined state) to the set's table.
void CoordinatorAdd(ProcessSet& ps, int member, std::vector<Request> reqs, bool joined);

// Removes and returns every ready name as a validated response, fused.
// Names that waited longer than stall_s for some members add a line to
// *warnings naming who submitted them and who did not (once per name).
// A name that cannot complete fails with a kMismatch response once it has waited
// longer than mismatch_s (> 0) and every member missing from it has itself waited
// that long on other names (a rank that is alive but submits different
// collectives, e.g. after its script raised and moved on): the error names the
// tensor and the names those members wait on. A silent member is not such a
// case; its peers' communicator timeout reports it.
std::vector<Response> CoordinatorReady(ProcessSet& ps, int64_t fusion_threshold, double stall_s,
                                       double mismatch_s, std::vector<std::string>* warnings);

// Merges cached single-name responses of the same group into one response.
std::vector<Response> MergeGroups(std::vector<Response> ready);

}  // namespace sdl
