#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.options: the man pages and the bash completion against each command's --help. For every
# subcommand `qcommit --help` lists, and for qcommitd, the long options its --help shows (the
# option column, not the descriptions) must each be named in the man page (as *--option*, the
# way the pages set options) and in packaging/qcommit.bash-completion (qcommit: the subcommand's
# list, the options every subcommand takes and the subcommand names; qcommitd: its own
# completion function). The other way round, every *--option* the qcommit page names must be an
# option of some qcommit subcommand, every option the qcommitd page lists (its SYNOPSIS and the
# entries of its OPTIONS) one of qcommitd's, and every option the completion offers for a
# subcommand one of that subcommand's; an option a usage synopsis names (qcommit status
# --domain-event, parsed before the option table) counts as one. An option that stands for a
# positional argument of the synopsis (--image for IMAGE, --top for TOP) need not be named.
# --help itself is left out. The pages must pass scdoc (where it is installed) and the
# completion bash -n. Prints each gap; exits 1 when there is one.
# usage: man-completion.sh QCOMMIT QCOMMITD QCOMMIT.1.scd QCOMMITD.8.scd COMPLETION
set -euo pipefail
QCOMMIT=$1
QCOMMITD=$2
man1=$3
man8=$4
completion=$5
gaps=()
gap() { gaps+=("$*"); }

# The long options of a --help text: the first long option of each line of the option column
# ("  --base arg", "  -c [ --connect ] arg"), --help left out.
help_options() {
  sed -nE 's/^  (-[a-zA-Z] \[ )?(--[a-z0-9][a-z0-9-]*).*/\2/p' | { grep -vx -- '--help' || true; } | sort -u
}
# The usage synopsis of a --help text (from "usage:" to the first empty line).
usage_block() { sed -n '/^usage:/,/^$/p'; }
# The long options a synopsis names.
usage_options() { usage_block | { grep -oE -- '--[a-z0-9][a-z0-9-]*' || true; } | sort -u; }
# Whether option $1 stands for a positional argument of synopsis $2: --image for IMAGE.
positional() { grep -qw -- "$(tr 'a-z-' 'A-Z_' <<<"${1#--}")" <<<"$2"; }
# Options a man page sets in bold: *--name*.
bold_options() { { grep -oE '\*--[a-z0-9][a-z0-9-]*\*' "$1" || true; } | tr -d '*' | sort -u; }
# The options the completion offers for subcommand $1: its `CMD) opts+="..."` line (a line may
# name several commands: "info|map)").
completion_options() {
  sed -nE "s/^ *([a-z|]*\\|)?$1(\\|[a-z|]*)?\\) opts\\+=\"([^\"]*)\".*/\\3/p" "$completion" |
    grep -oE -- '--[a-z0-9][a-z0-9-]*' | sort -u
}
# Offered to every subcommand: the `local opts="..."` line.
common_options() { sed -nE 's/^ *local opts="([^"]*)".*/\1/p' "$completion" | grep -oE -- '--[a-z0-9][a-z0-9-]*' | sort -u; }
# The subcommand names completed after `qcommit`.
completion_commands() { sed -nE 's/.*compgen -W "([a-z ]*)" -- "\$cur".*/\1/p' "$completion" | head -1 | tr ' ' '\n'; }

[[ -s $man1 && -s $man8 && -s $completion ]] || { echo "docs.options: missing input" >&2; exit 1; }
# The pages must turn into man pages at all (the package's man target runs scdoc).
if command -v scdoc >/dev/null; then
  for page in "$man1" "$man8"; do
    err=$(scdoc <"$page" 2>&1 >/dev/null) || gap "$(basename "$page"): scdoc refuses it: $err"
  done
fi
bash -n "$completion" || gap "$(basename "$completion"): not valid bash"
commands=$("$QCOMMIT" --help | sed -nE 's/^  ([a-z]+) .*/\1/p' | sort -u)
[[ -n $commands ]] || { echo "docs.options: qcommit --help lists no commands" >&2; exit 1; }
all_qcommit=
common=$(common_options)
for cmd in $commands; do
  grep -qx "$cmd" <(completion_commands) || gap "qcommit $cmd: not among the commands the completion offers"
  help=$("$QCOMMIT" "$cmd" --help)
  opts=$(help_options <<<"$help")
  [[ -n $opts ]] || gap "qcommit $cmd --help: no options found"
  synopsis=$(usage_block <<<"$help" | sed -E 's/--[a-z0-9-]+//g')
  all_qcommit+=$'\n'$opts$'\n'$(usage_options <<<"$help")
  offered=$(sort -u <(completion_options "$cmd") <(echo "$common"))
  for o in $opts; do
    positional "$o" "$synopsis" && continue
    grep -qx -- "$o" <(bold_options "$man1") || gap "qcommit $cmd $o: not in the man page ($(basename "$man1"))"
    grep -qx -- "$o" <<<"$offered" || gap "qcommit $cmd $o: not in the completion"
  done
  for o in $(completion_options "$cmd"); do
    grep -qx -- "$o" <<<"$opts" || gap "qcommit $cmd $o: offered by the completion, not an option of $cmd"
  done
  echo "qcommit $cmd: $(wc -w <<<"$opts") long options"
done
for o in $common; do
  [[ $o == --help ]] && continue
  for cmd in $commands; do
    "$QCOMMIT" "$cmd" --help | help_options | grep -qx -- "$o" ||
      gap "qcommit $cmd $o: offered by the completion to every command, not an option of $cmd"
  done
done
for o in $(bold_options "$man1"); do
  [[ $o == --help || $o == --version ]] && continue
  grep -qx -- "$o" <<<"$all_qcommit" || gap "$(basename "$man1") names $o: no qcommit command has it"
done

# qcommitd: its page's SYNOPSIS and OPTIONS entries, and a _qcommitd completion function.
dhelp=$("$QCOMMITD" --help)
dopts=$(help_options <<<"$dhelp")
[[ -n $dopts ]] || gap "qcommitd --help: no options found"
page_dopts=$(awk '/^# /{s=$2} s=="SYNOPSIS"||s=="OPTIONS"' "$man8" | { grep -oE '\*--[a-z0-9][a-z0-9-]*\*' || true; } |
  tr -d '*' | sort -u)
dcompl=$(sed -n '/^_qcommitd()/,/^}/p' "$completion" | { grep -oE -- '--[a-z0-9][a-z0-9-]*' || true; } | sort -u)
[[ -n $dcompl ]] || gap "qcommitd: the completion has no _qcommitd function"
for o in $dopts; do
  grep -qx -- "$o" <<<"$page_dopts" || gap "qcommitd $o: not in the man page ($(basename "$man8"), SYNOPSIS or OPTIONS)"
  [[ -z $dcompl ]] || grep -qx -- "$o" <<<"$dcompl" || gap "qcommitd $o: not in the completion"
done
for o in $page_dopts; do
  [[ $o == --help || $o == --version ]] && continue
  grep -qx -- "$o" < <(echo "$dopts"; usage_options <<<"$dhelp") || gap "$(basename "$man8") lists $o: qcommitd has no such option"
done
for o in $dcompl; do
  [[ $o == --help ]] && continue
  grep -qx -- "$o" <<<"$dopts" || gap "qcommitd $o: offered by the completion, not an option of qcommitd"
done
echo "qcommitd: $(wc -w <<<"$dopts") long options"

if ((${#gaps[@]})); then
  printf '  %s\n' "${gaps[@]}" >&2
  echo "docs.options: ${#gaps[@]} gaps" >&2
  exit 1
fi
echo "docs.options: OK"
