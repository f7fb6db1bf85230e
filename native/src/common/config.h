// Typed configuration built once from the knob table (knobs.def).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sdl {

struct Config {
#define SDL_KNOB_bool bool
#define SDL_KNOB_int64 int64_t
#define SDL_KNOB_double double
#define SDL_KNOB_string std::string
#define SDL_KNOB(field, env, type, def, tunable, doc) SDL_KNOB_##type field = def;
#include "common/knobs.def"
#undef SDL_KNOB

  // Reads every knob's environment variable; unset ones keep their default.
  // Throws std::invalid_argument naming the variable when a value does not parse.
  static Config FromEnv();

  // Sets one knob by field name from its string form (same parsing as the env).
  void Set(const std::string& field, const std::string& value);

  // Field name -> current value as text, in table order.
  std::vector<std::pair<std::string, std::string>> Items() const;
};

struct KnobInfo {
  std::string field, env, type, default_value, doc;
  bool tunable;
};

// The table itself, for the Python layer and start-up logging.
const std::vector<KnobInfo>& KnobTable();

}  // namespace sdl
