#include "common/config.h"

#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace sdl {
namespace {

template <typename T> std::string TypeName();
template <> std::string TypeName<bool>() { return "bool"; }
template <> std::string TypeName<int64_t>() { return "int64"; }
template <> std::string TypeName<double>() { return "double"; }
template <> std::string TypeName<std::string>() { return "string"; }

void Parse(const std::string& name, const std::string& text, bool* out) {
  std::string v;
  for (char c : text) v.push_back(static_cast<char>(tolower(c)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") *out = true;
  else if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) *out = false;
  else throw std::invalid_argument(name + "=" + text + ": expected a boolean (1/0, true/false)");
}
void Parse(const std::string& name, const std::string& text, int64_t* out) {
  try {
    size_t pos = 0;
    long long v = std::stoll(text, &pos);
    if (pos != text.size()) throw std::invalid_argument("trailing");
    *out = v;
  } catch (const std::exception&) {
    throw std::invalid_argument(name + "=" + text + ": expected an integer");
  }
}
void Parse(const std::string& name, const std::string& text, double* out) {
  try {
    size_t pos = 0;
    double v = std::stod(text, &pos);
    if (pos != text.size()) throw std::invalid_argument("trailing");
    *out = v;
  } catch (const std::exception&) {
    throw std::invalid_argument(name + "=" + text + ": expected a number");
  }
}
void Parse(const std::string&, const std::string& text, std::string* out) { *out = text; }

std::string Show(bool v) { return v ? "true" : "false"; }
std::string Show(int64_t v) { return std::to_string(v); }
std::string Show(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}
std::string Show(const std::string& v) { return v; }

}  // namespace

Config Config::FromEnv() {
  Config c;
#define SDL_KNOB(field, env, type, def, tunable, doc)        \
  if (const char* v = std::getenv(#env)) Parse(#env, v, &c.field);
#include "common/knobs.def"
#undef SDL_KNOB
  return c;
}

void Config::Set(const std::string& name, const std::string& value) {
#define SDL_KNOB(field, env, type, def, tunable, doc)                      \
  if (name == #field || name == #env) return Parse(#env, value, &field);
#include "common/knobs.def"
#undef SDL_KNOB
  throw std::invalid_argument("unknown knob '" + name + "'");
}

std::vector<std::pair<std::string, std::string>> Config::Items() const {
  std::vector<std::pair<std::string, std::string>> items;
#define SDL_KNOB(field, env, type, def, tunable, doc) items.emplace_back(#field, Show(field));
#include "common/knobs.def"
#undef SDL_KNOB
  return items;
}

const std::vector<KnobInfo>& KnobTable() {
  static const std::vector<KnobInfo> table = [] {
    std::vector<KnobInfo> t;
    Config defaults;
#define SDL_KNOB(field, env, type, def, tunable, doc) \
  t.push_back({#field, #env, TypeName<SDL_KNOB_##type>(), Show(defaults.field), doc, tunable});
#include "common/knobs.def"
#undef SDL_KNOB
    return t;
  }();
  return table;
}

}  // namespace sdl
