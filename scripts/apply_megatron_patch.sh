#!/usr/bin/env bash
# Apply the SparseBalance patches (patches/README.md) to a Megatron-LM checkout:
#   patches/megatron_lm_pretrain_gpt.patch     -> pretrain_gpt.py    (GPTModel)
#   patches/megatron_lm_pretrain_hybrid.patch  -> pretrain_hybrid.py (HybridModel; skipped, with a
#                                                 note, in a checkout that has no such script)
#
#   scripts/apply_megatron_patch.sh [--check | --revert] DIR
#
# DIR must be a Megatron-LM checkout (pretrain_gpt.py and megatron/training/ at its top).
# Checks every patch first (git apply --check) and touches nothing unless all of them fit, never
# leaves a half-applied file, and is idempotent: a file that already carries its patch is reported
# and left alone (exit 0).
#   --check   only report whether each patch applies, is already applied, or does not apply
#   --revert  take the patches out again
# SB_PATCH=FILE: use only that patch file.
# Exit status: 0 applied / already applied / reverted, 1 a patch does not apply, 2 bad usage or
# DIR is not a Megatron-LM checkout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${SB_PATCH:-}" ]]; then
  PATCHES=("$SB_PATCH")
else
  PATCHES=("$HERE/../patches/megatron_lm_pretrain_gpt.patch"
           "$HERE/../patches/megatron_lm_pretrain_hybrid.patch")
fi
MODE=apply

usage() { echo "usage: $0 [--check | --revert] MEGATRON_LM_DIR" >&2; exit 2; }
die() { echo "error: $1" >&2; exit "${2:-2}"; }

DIR=""
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --revert) MODE=revert ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    -*) echo "error: unknown option '$a'" >&2; usage ;;
    *) [[ -z "$DIR" ]] || { echo "error: more than one directory given ('$DIR', '$a')" >&2; usage; }
       DIR="$a" ;;
  esac
done
[[ -n "$DIR" ]] || usage
for p in "${PATCHES[@]}"; do [[ -f "$p" ]] || die "patch file not found: $p"; done
[[ -d "$DIR" ]] || die "'$DIR' is not a directory (expected a Megatron-LM checkout)"
DIR="$(cd "$DIR" && pwd)"
if [[ ! -f "$DIR/pretrain_gpt.py" || ! -d "$DIR/megatron/training" ]]; then
  missing=()
  [[ -f "$DIR/pretrain_gpt.py" ]] || missing+=("pretrain_gpt.py")
  [[ -d "$DIR/megatron/training" ]] || missing+=("megatron/training/")
  die "'$DIR' is not a Megatron-LM checkout: no ${missing[*]} at its top (clone https://github.com/NVIDIA/Megatron-LM and pass its root directory)"
fi
command -v git >/dev/null || die "git is required (git apply)"

# Paths in the patches are relative to DIR: keep git from discovering a repository above DIR.
gitapply() { local patch="$1"; shift
  GIT_CEILING_DIRECTORIES="$(dirname "$DIR")" git -C "$DIR" apply "$@" "$patch"; }
# The file a patch changes: its '+++ b/FILE' header.
target() { sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$1" | head -n 1; }

# Every patch's state first: applied, clean, absent (no target file) or conflict.
states=(); targets=(); errors=()
conflicts=0
for p in "${PATCHES[@]}"; do
  t="$(target "$p")"
  [[ -n "$t" ]] || die "$p has no '+++ b/FILE' header"
  targets+=("$t"); err=""
  if [[ ! -f "$DIR/$t" ]]; then
    s=absent
  elif gitapply "$p" --reverse --check 2>/dev/null; then
    s=applied
  elif err="$(gitapply "$p" --check 2>&1)"; then
    s=clean
  else
    s=conflict; conflicts=$((conflicts + 1))
  fi
  states+=("$s"); errors+=("$err")
done

if (( conflicts > 0 )) && [[ "$MODE" != revert ]]; then
  for i in "${!PATCHES[@]}"; do
    [[ "${states[$i]}" == conflict ]] || continue
    echo "error: the patch does not apply to $DIR/${targets[$i]}:" >&2
    echo "${errors[$i]}" | sed 's/^/  /' >&2
  done
  echo "It was made against the megatron-core 0.19 flow of the script's __main__ block" >&2
  echo "(parse_and_validate_args -> gpt/hybrid_config_from_args ->" >&2
  echo " pretrain_cfg_container_from_args). Nothing was changed." >&2
  echo "See patches/README.md for the calls to make by hand in other versions." >&2
  exit 1
fi

for i in "${!PATCHES[@]}"; do
  p="${PATCHES[$i]}"; f="$DIR/${targets[$i]}"
  case "$MODE:${states[$i]}" in
    *:absent) echo "skipped: $f does not exist (a checkout before it; nothing to patch)" ;;
    check:applied) echo "already applied: $f carries the SparseBalance patch" ;;
    check:clean) echo "applies cleanly to $f" ;;
    apply:applied) echo "already applied: $f carries the SparseBalance patch; nothing to do" ;;
    apply:clean)
      gitapply "$p"
      echo "applied: $f now adds the --sparse-balance/--sb-* flags, the SparseBalance attention"
      echo "and step hooks." ;;
    revert:applied) gitapply "$p" --reverse; echo "reverted: $f is back to upstream" ;;
    revert:clean) echo "not applied: nothing to revert in $f" ;;
    revert:conflict) echo "not applied and not upstream: $f left as it is" ;;
  esac
done
if [[ "$MODE" == apply ]]; then
  echo "Install the plugin in that environment: pip install -e $(cd "$HERE/.." && pwd)"
fi
