// Typed configuration built once from the knob table.
//
// The table is the Python package's spark_dl/config/knobs.json; CMake generates
// "common/knobs.inc" from it (native/cmake/knobs.cmake), one row per knob the core reads:
//   SDL_KNOB(field, ENV_NAME, type, default, tunable, "choices", "fallback_env", "doc")
// so C++ and Python share one table and one value grammar (ParseKnobText below and
// spark_dl/config/knobs.py implement the same rules; a test feeds both the same strings).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace sdl {

// The C++ type of each knob type.
#define SDL_KNOB_CXX_bool bool
#define SDL_KNOB_CXX_int int64_t
#define SDL_KNOB_CXX_double double
#define SDL_KNOB_CXX_duration double  // seconds
#define SDL_KNOB_CXX_string std::string
#define SDL_KNOB_CXX_enum std::string  // one of the row's choices

struct Config {
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc) \
  SDL_KNOB_CXX_##type field = def;
#include "common/knobs.inc"
#undef SDL_KNOB

  // Reads every knob's environment variable (then its fallback variable); unset or
  // blank ones keep their default. Throws std::invalid_argument naming the variable, the
  // text and what was expected when a value does not parse.
  static Config FromEnv();

  // Sets one knob by field or variable name from its text form (the environment's
  // grammar; blank text restores the default).
  void Set(const std::string& name, const std::string& value);

  // Field name -> current value as text, in table order.
  std::vector<std::pair<std::string, std::string>> Items() const;
};

struct KnobInfo {
  std::string field, env, type, default_value, doc, choices, fallback_env;
  bool tunable;
};

// The core's rows of the table, for the Python layer and start-up logging.
const std::vector<KnobInfo>& KnobTable();

using KnobValue = std::variant<bool, int64_t, double, std::string>;

// Parses text as the value of knob `name` (field or variable name): the value, or the
// knob's default for blank text. Throws std::invalid_argument like Config::FromEnv, or
// for an unknown name.
KnobValue ParseKnob(const std::string& name, const std::string& text);

}  // namespace sdl
