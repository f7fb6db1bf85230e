#include "common/config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <system_error>

namespace sdl {
namespace {

// --- the value grammar (spark_dl/config/knobs.py implements the same rules) -------------

constexpr const char* kSpace = " \t\n\r\f\v";

std::string Trim(const std::string& s) {
  size_t b = s.find_first_not_of(kSpace);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(kSpace) - b + 1);
}

bool IsBlank(const std::string& s) { return s.find_first_not_of(kSpace) == std::string::npos; }

// ASCII only, as in Python: a non-ASCII letter never matches a choice.
std::string Lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

[[noreturn]] void Fail(const std::string& var, const std::string& text, const std::string& what) {
  throw std::invalid_argument(var + "=" + text + ": expected " + what);
}

size_t Digits(const std::string& s, size_t i) {
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  return i;
}

// End of the unsigned decimal number starting at s[i]:
//   (digits ['.' digits*] | '.' digits) [('e'|'E') ['+'|'-'] digits]
// i when there is none. An 'e' without exponent digits ends the number before it.
size_t ScanUnsigned(const std::string& s, size_t i) {
  size_t j = Digits(s, i);
  if (j < s.size() && s[j] == '.') {
    size_t k = Digits(s, j + 1);
    if (j == i && k == j + 1) return i;  // "." alone
    j = k;
  } else if (j == i) {
    return i;
  }
  if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
    size_t k = j + 1;
    if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
    size_t m = Digits(s, k);
    if (m > k) j = m;
  }
  return j;
}

// A text matching [+-]?number as a finite double; none when out of range (overflow, or a
// non-zero mantissa that rounds to zero: from_chars refuses both).
std::optional<double> Number(const std::string& t) {
  const char* b = t.data();
  const char* e = b + t.size();
  if (b != e && *b == '+') ++b;  // from_chars takes '-' only
  double v = 0;
  auto r = std::from_chars(b, e, v);
  if (r.ec != std::errc() || r.ptr != e || std::isinf(v)) return std::nullopt;
  return v;
}

bool Parse_bool(const std::string& var, const std::string& text, const char*) {
  std::string v = Lower(Trim(text));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  Fail(var, text, "a boolean (1/0, true/false, yes/no, on/off)");
}

int64_t Parse_int(const std::string& var, const std::string& text, const char*) {
  std::string s = Trim(text);
  size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  if (s.size() > sign && Digits(s, sign) == s.size()) {
    int64_t v = 0;
    const char* b = s.data() + (s[0] == '+' ? 1 : 0);
    auto r = std::from_chars(b, s.data() + s.size(), v);
    if (r.ec == std::errc() && r.ptr == s.data() + s.size()) return v;
  }
  Fail(var, text, "an integer");
}

double Parse_double(const std::string& var, const std::string& text, const char*) {
  std::string s = Trim(text);
  size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  if (ScanUnsigned(s, sign) == s.size() && s.size() > sign)
    if (auto v = Number(s)) return *v;
  Fail(var, text, "a number");
}

double Parse_duration(const std::string& var, const std::string& text, const char*) {
  std::string s = Trim(text);
  size_t end = ScanUnsigned(s, 0);
  if (end > 0) {
    size_t u = s.find_first_not_of(kSpace, end);
    std::string unit = u == std::string::npos ? "" : s.substr(u);
    std::optional<double> v = Number(s.substr(0, end));
    if (v && (unit.empty() || unit == "ms" || unit == "s" || unit == "m" || unit == "h")) {
      double seconds = unit == "ms" ? *v / 1000.0
                       : unit == "m" ? *v * 60.0 : unit == "h" ? *v * 3600.0 : *v;
      if (!std::isinf(seconds)) return seconds;
    }
  }
  Fail(var, text, "a duration (seconds, or a number with a unit: 500ms, 30s, 2m, 1h)");
}

std::string Parse_string(const std::string&, const std::string& text, const char*) {
  return Trim(text);
}

std::string Parse_enum(const std::string& var, const std::string& text, const char* choices) {
  std::string v = Lower(Trim(text)), list, all = choices;
  for (size_t b = 0; b <= all.size();) {
    size_t e = all.find('|', b);
    if (e == std::string::npos) e = all.size();
    std::string choice = all.substr(b, e - b);
    if (v == choice) return choice;
    list += (list.empty() ? "" : ", ") + choice;
    b = e + 1;
  }
  Fail(var, text, "one of " + list);
}

std::string Show(bool v) { return v ? "true" : "false"; }
std::string Show(int64_t v) { return std::to_string(v); }
std::string Show(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);  // shortest text that reads back as v
  return std::string(buf, r.ptr);
}
std::string Show(const std::string& v) { return v; }

// The value of `env`, else of `fallback` when set: nullptr when both are unset or blank.
const char* Lookup(const char* env, const char* fallback, std::string* var) {
  for (const char* name : {env, fallback}) {
    const char* v = *name ? std::getenv(name) : nullptr;
    if (v && !IsBlank(v)) {
      *var = name;
      return v;
    }
  }
  return nullptr;
}

}  // namespace

Config Config::FromEnv() {
  Config c;
  std::string var;
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc) \
  if (const char* v = Lookup(#env, fallback, &var)) c.field = Parse_##type(var, v, choices);
#include "common/knobs.inc"
#undef SDL_KNOB
  return c;
}

void Config::Set(const std::string& name, const std::string& value) {
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc)          \
  if (name == #field || name == #env) {                                          \
    field = IsBlank(value) ? Config().field : Parse_##type(#env, value, choices); \
    return;                                                                      \
  }
#include "common/knobs.inc"
#undef SDL_KNOB
  throw std::invalid_argument("unknown knob '" + name + "'");
}

std::vector<std::pair<std::string, std::string>> Config::Items() const {
  std::vector<std::pair<std::string, std::string>> items;
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc) \
  items.emplace_back(#field, Show(field));
#include "common/knobs.inc"
#undef SDL_KNOB
  return items;
}

const std::vector<KnobInfo>& KnobTable() {
  static const std::vector<KnobInfo> table = [] {
    std::vector<KnobInfo> t;
    Config defaults;
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc) \
  t.push_back({#field, #env, #type, Show(defaults.field), doc, choices, fallback, tunable});
#include "common/knobs.inc"
#undef SDL_KNOB
    return t;
  }();
  return table;
}

KnobValue ParseKnob(const std::string& name, const std::string& text) {
  Config c;
  c.Set(name, text);
#define SDL_KNOB(field, env, type, def, tunable, choices, fallback, doc) \
  if (name == #field || name == #env) return KnobValue(std::in_place_type<SDL_KNOB_CXX_##type>, c.field);
#include "common/knobs.inc"
#undef SDL_KNOB
  throw std::invalid_argument("unknown knob '" + name + "'");
}

}  // namespace sdl
