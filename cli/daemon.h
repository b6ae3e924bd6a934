// Whether qcommitd answers on its control socket (a connect, no request).
#pragma once

#include <string>

namespace qcommit::cli {

inline constexpr const char* kDaemonSocket = "/run/qcommit/qcommitd.sock";

[[nodiscard]] bool qcommitd_answers(const std::string& socket_path);

}  // namespace qcommit::cli
