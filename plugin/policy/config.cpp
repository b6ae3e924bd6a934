// SPDX-License-Identifier: GPL-2.0-or-later
#include "plugin/policy/config.h"

#include <glib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "plugin/host/xml.h"

namespace qcommit::plugin {
namespace {

struct GFreeDeleter {
  void operator()(void* p) const { g_free(p); }
};
struct GStrvDeleter {
  void operator()(char** p) const { g_strfreev(p); }
};
struct KeyFileDeleter {
  void operator()(GKeyFile* k) const { g_key_file_free(k); }
};
struct ErrorDeleter {
  void operator()(GError* e) const { g_error_free(e); }
};

}  // namespace

std::chrono::nanoseconds parse_duration(const std::string& s, const std::string& what) {
  std::string error;
  const auto d = read_duration(s, error);
  if (!d) throw ConfigError(what + ": " + error);
  return *d;
}

double parse_size(const std::string& s, const std::string& what) {
  std::string error;
  const auto v = units::read_size(s, error);
  if (!v) throw ConfigError(what + ": " + error);
  return *v;
}

std::optional<std::string> Policy::validate() const {
  if (auto e = units::budget_problem(budget)) return "budget " + *e;
  if (!(floor_bytes_per_s >= units::kMinRateBytesPerS)) return "floor must be >= 4K (bytes/s)";
  if (!(ceiling_bytes_per_s >= floor_bytes_per_s)) return "ceiling must be >= floor";
  if (!(ceiling_bytes_per_s <= kMaxCeilingBytesPerS)) return "ceiling must be <= 1T (bytes/s)";
  if (auto e = probe_config().validate()) return *e + " (or auto, off)";
  return std::nullopt;
}

throttle::ProbeConfig Policy::probe_config() const {
  throttle::ProbeConfig c;
  c.enabled = probe != ProbeMode::kOff;
  c.period = probe_period;
  return c;
}

throttle::ControllerConfig Policy::controller_config() const {
  throttle::ControllerConfig c;
  c.latency_budget = throttle::request_budget(budget);
  c.floor_rate_bytes_per_s = floor_bytes_per_s;
  c.ceiling_rate_bytes_per_s = ceiling_bytes_per_s;
  c.initial_rate_bytes_per_s = std::clamp(c.initial_rate_bytes_per_s, floor_bytes_per_s,
                                          ceiling_bytes_per_s);
  // The daemon ticks every 100 ms (QEMU enforces speed in 100 ms slices).
  c.tick_interval = std::chrono::milliseconds(100);
  return c;
}

std::optional<std::string> DaemonConfig::validate() const {
  if (auto e = defaults.validate()) return "[default]: " + *e;
  for (const auto& [k, p] : pools)
    if (auto e = p.validate()) return "[pool:" + k + "]: " + *e;
  if (uri.empty()) return "uri must not be empty";
  if (socket_path.empty() || socket_path.size() >= 108) return "socket path empty or too long";
  return std::nullopt;
}

void read_probe(const std::string& value, const std::string& what, Policy& p) {
  if (value == "off") {
    p.probe = ProbeMode::kOff;
  } else if (value == "auto") {
    p.probe = ProbeMode::kAuto;
    p.probe_period = defaults::kProbePeriod;
  } else {
    p.probe = ProbeMode::kOn;
    p.probe_period = parse_duration(value, what);
  }
}

namespace {

// Applies the keys of `group` onto `p`.  Throws ConfigError.
void read_policy_group(GKeyFile* kf, const char* group, const std::string& where, Policy& p) {
  gsize n = 0;
  std::unique_ptr<char*, GStrvDeleter> keys(g_key_file_get_keys(kf, group, &n, nullptr));
  for (gsize i = 0; i < n; ++i) {
    const std::string key = keys.get()[i];
    std::unique_ptr<char, GFreeDeleter> raw(g_key_file_get_value(kf, group, key.c_str(), nullptr));
    const std::string value = raw ? raw.get() : "";
    const std::string what = where + " " + key;
    if (key == "budget") p.budget = parse_duration(value, what);
    else if (key == "floor") p.floor_bytes_per_s = parse_size(value, what);
    else if (key == "ceiling") p.ceiling_bytes_per_s = parse_size(value, what);
    else if (key == "probe")
      read_probe(value, what, p);
    else
      throw ConfigError(where + ": unknown key '" + key +
                        "' (known: budget, floor, ceiling, probe)");
  }
  if (auto e = p.validate()) throw ConfigError(where + ": " + *e);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool looks_like_uuid(const std::string& s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (s[i] != '-') return false;
    } else if (!std::isxdigit(static_cast<unsigned char>(s[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

DaemonConfig parse_config(const std::string& text, const std::string& origin) {
  DaemonConfig cfg;
  cfg.origin = origin;
  std::unique_ptr<GKeyFile, KeyFileDeleter> kf(g_key_file_new());
  GError* raw_err = nullptr;
  if (!g_key_file_load_from_data(kf.get(), text.data(), text.size(), G_KEY_FILE_NONE, &raw_err)) {
    std::unique_ptr<GError, ErrorDeleter> err(raw_err);
    throw ConfigError(origin + ": " + (err ? err->message : "cannot parse"));
  }
  gsize ngroups = 0;
  std::unique_ptr<char*, GStrvDeleter> groups(g_key_file_get_groups(kf.get(), &ngroups));
  // [default] first, so that pools inherit it.
  if (g_key_file_has_group(kf.get(), "default")) {
    read_policy_group(kf.get(), "default", origin + ": [default]", cfg.defaults);
    cfg.has_default = true;
  }
  for (gsize i = 0; i < ngroups; ++i) {
    const std::string g = groups.get()[i];
    if (g == "default") continue;
    if (g.rfind("pool:", 0) == 0 && g.size() > 5) {
      std::string key = g.substr(5);
      if (looks_like_uuid(key)) key = lower(key);
      if (cfg.pools.count(key)) throw ConfigError(origin + ": [" + g + "] appears twice");
      Policy p = cfg.defaults;
      read_policy_group(kf.get(), g.c_str(), origin + ": [" + g + "]", p);
      cfg.pools.emplace(key, p);
      continue;
    }
    throw ConfigError(origin + ": unknown section [" + g + "] (expected [default] or [pool:NAME])");
  }
  if (auto e = cfg.validate()) throw ConfigError(origin + ": " + *e);
  return cfg;
}

DaemonConfig load_config(const std::string& path, bool missing_ok) {
  // The default path means "the policy file if there is one", also when it is named (the
  // packaged unit passes it): missing is the built-in policy.
  missing_ok = missing_ok || path == defaults::kConfigPath;
  gchar* data = nullptr;
  gsize len = 0;
  GError* raw_err = nullptr;
  if (!g_file_get_contents(path.c_str(), &data, &len, &raw_err)) {
    std::unique_ptr<GError, ErrorDeleter> err(raw_err);
    if (missing_ok && err && g_error_matches(err.get(), G_FILE_ERROR, G_FILE_ERROR_NOENT))
      return DaemonConfig{};
    throw ConfigError(path + ": " + (err ? err->message : "cannot read"));
  }
  std::unique_ptr<char, GFreeDeleter> owned(data);
  return parse_config(std::string(data, len), path);
}

Policy policy_for_pool(const DaemonConfig& cfg, const std::string* pool_name,
                       const std::string* pool_uuid) {
  if (pool_name) {
    if (auto it = cfg.pools.find(*pool_name); it != cfg.pools.end()) return it->second;
  }
  if (pool_uuid) {
    if (auto it = cfg.pools.find(lower(*pool_uuid)); it != cfg.pools.end()) return it->second;
  }
  return cfg.defaults;
}

namespace {

// The local name of an element or attribute ("policy" for qcommit:policy, also when libxml2
// keeps an undeclared prefix in the name).
std::string local_name(const xmlChar* name) {
  std::string n = reinterpret_cast<const char*>(name);
  if (auto c = n.find(':'); c != std::string::npos) n.erase(0, c + 1);
  return n;
}

// The first <policy> element of the metadata, whatever its prefix.
xmlNodePtr find_policy(xmlDocPtr doc) {
  for (xmlNodePtr n : xml::select(doc, "descendant-or-self::*"))
    if (local_name(n->name) == "policy") return n;
  return nullptr;
}

// Applies one attribute of <qcommit:policy/> to `p`; an error for an attribute it does not know.
std::optional<std::string> apply_policy_attribute(xmlAttrPtr a, Policy& p, bool& budget_given) {
  std::string name = reinterpret_cast<const char*>(a->name);
  if (a->ns && a->ns->prefix) name = reinterpret_cast<const char*>(a->ns->prefix) + (":" + name);
  const std::string value = xml::text(reinterpret_cast<xmlNodePtr>(a));
  const std::string what = "domain metadata policy " + name;
  try {
    if (name == "budget") {
      p.budget = parse_duration(value, what);
      budget_given = true;
    } else if (name == "floor") {
      p.floor_bytes_per_s = parse_size(value, what);
    } else if (name == "ceiling") {
      p.ceiling_bytes_per_s = parse_size(value, what);
    } else {
      return "domain metadata policy: unknown attribute '" + name + "'";
    }
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> apply_domain_override(const std::string& text, Policy& p,
                                                 bool* budget_given) {
  const xml::Doc doc = xml::parse(text);
  if (!doc) return std::string("domain metadata policy: bad XML (not well-formed)");
  const xmlNodePtr policy = find_policy(doc.get());
  if (!policy) return std::string("domain metadata: no <qcommit:policy/> element");
  Policy candidate = p;
  bool given = false;
  for (xmlAttrPtr a = policy->properties; a; a = a->next)
    if (auto e = apply_policy_attribute(a, candidate, given)) return e;
  if (auto e = candidate.validate()) return "domain metadata policy: " + *e;
  p = candidate;
  if (budget_given) *budget_given = given;
  return std::nullopt;
}

const char* to_string(PolicySource s) {
  switch (s) {
    case PolicySource::Option: return "option";
    case PolicySource::DomainMetadata: return "domain-metadata";
    case PolicySource::PoolPolicy: return "pool-policy";
    case PolicySource::DefaultPolicy: return "default-policy";
    case PolicySource::BuiltIn: return "built-in";
  }
  return "?";
}

PolicyResolution resolve_policy(const DaemonConfig& cfg, const PolicyQuery& q) {
  PolicyResolution r;
  r.policy = cfg.defaults;  // the built-in values unless the file has [default]
  if (cfg.has_default) {
    r.source = PolicySource::DefaultPolicy;
    r.detail = "[default] in " + cfg.origin;
  } else {
    r.source = PolicySource::BuiltIn;
    r.detail = cfg.origin.empty() ? "built-in default" : "built-in default (" + cfg.origin + " has no [default])";
  }
  auto pool = cfg.pools.end();
  if (q.pool_name) pool = cfg.pools.find(*q.pool_name);
  if (pool == cfg.pools.end() && q.pool_uuid) pool = cfg.pools.find(lower(*q.pool_uuid));
  if (pool != cfg.pools.end()) {
    r.policy = pool->second;  // sections inherit [default]
    r.source = PolicySource::PoolPolicy;
    r.detail = "[pool:" + pool->first + "] in " + cfg.origin;
  }
  if (q.domain_policy_xml) {
    bool budget_given = false;
    if (auto e = apply_domain_override(*q.domain_policy_xml, r.policy, &budget_given)) {
      r.metadata_error = *e;
    } else if (budget_given) {
      r.source = PolicySource::DomainMetadata;
      r.detail = "domain metadata";
    }
  }
  if (q.budget_option) {
    r.policy.budget = *q.budget_option;
    r.source = PolicySource::Option;
    r.detail = "--budget";
  }
  return r;
}

}  // namespace qcommit::plugin
