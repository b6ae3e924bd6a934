// SPDX-License-Identifier: GPL-2.0-or-later
// doctest's runner, compiled once for every doctest executable (qcommit_doctest_main).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
