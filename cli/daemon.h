// Whether qcommitd answers on its control socket (a connect, no request).
#pragma once

#include <string>

namespace qcommit::cli {

[[nodiscard]] bool qcommitd_answers(const std::string& socket_path);

}  // namespace qcommit::cli
