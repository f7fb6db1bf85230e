// The coordinator's half of negotiation (runs on member 0 of a process set).
//
// Steps c) and d) of the negotiation protocol described in core/controller.h:
// the table of requests per name, validation across members, groups, fusion.
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

// Appends a copy of the cached single-name response r to out, except that a
// member of a grouped allreduce joins its group's response there instead (one
// per group, dtype and device, as in the negotiation's group merge); groups
// holds the indices in out of the group responses so far. Members cost a name
// and a shape each, not a whole response.
void AppendMerged(std::vector<Response>* out, std::vector<size_t>* groups, const Response& r);

// Merges cached single-name responses of the same group into one response.
std::vector<Response> MergeGroups(const std::vector<Response>& ready);

}  // namespace sdl
