#!/usr/bin/env bash
# Apply the SparseBalance patches (patches/README.md) to a Megatron-LM checkout. Each script has a
# patch per flow of its __main__ block; the one that fits is applied:
#   pretrain_gpt.py (GPTModel):
#     patches/megatron_lm_pretrain_gpt.patch        core_r0.19.0, main
#     patches/megatron_lm_dev_pretrain_gpt.patch    dev
#   pretrain_hybrid.py (HybridModel):
#     patches/megatron_lm_pretrain_hybrid.patch     core_r0.19.0, main
#     patches/megatron_lm_dev_pretrain_hybrid.patch dev
#   (pretrain_hybrid.py is skipped, with a note, in a checkout that has no such script)
#
#   scripts/apply_megatron_patch.sh [--check | --revert] DIR
#
# DIR must be a Megatron-LM checkout (pretrain_gpt.py and megatron/training/ at its top).
# Checks every script first (git apply --check) and touches nothing unless each has a patch that
# fits, never leaves a half-applied file, and is idempotent: a file that already carries one of
# its patches is reported and left alone (exit 0).
#   --check   only report whether a patch applies, is already applied, or none applies
#   --revert  take the applied patches out again
# SB_PATCH=FILE: use only that patch file.
# Exit status: 0 applied / already applied / reverted, 1 no patch applies to a script, 2 bad usage
# or DIR is not a Megatron-LM checkout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${SB_PATCH:-}" ]]; then
  PATCHES=("$SB_PATCH")
else
  PATCHES=("$HERE/../patches/megatron_lm_pretrain_gpt.patch"
           "$HERE/../patches/megatron_lm_dev_pretrain_gpt.patch"
           "$HERE/../patches/megatron_lm_pretrain_hybrid.patch"
           "$HERE/../patches/megatron_lm_dev_pretrain_hybrid.patch")
fi
MODE=apply

usage() { echo "usage: $0 [--check | --revert] MEGATRON_LM_DIR" >&2; exit 2; }
die() { echo "error: $1" >&2; exit "${2:-2}"; }

DIR=""
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --revert) MODE=revert ;;
    -h|--help) sed -n 2,22p "$0"; exit 0 ;;
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

# Every script's state first: applied (one of its patches), clean (the first patch that fits),
# absent (no such file) or conflict (none fits).
targets=()
for p in "${PATCHES[@]}"; do
  t="$(target "$p")"
  [[ -n "$t" ]] || die "$p has no '+++ b/FILE' header"
  [[ " ${targets[*]} " == *" $t "* ]] || targets+=("$t")
done
states=(); chosen=(); errors=()
conflicts=0
for t in "${targets[@]}"; do
  s=conflict; use=""; err=""
  if [[ ! -f "$DIR/$t" ]]; then
    s=absent
  else
    for p in "${PATCHES[@]}"; do
      [[ "$(target "$p")" == "$t" ]] || continue
      if gitapply "$p" --reverse --check 2>/dev/null; then s=applied; use="$p"; break; fi
    done
    if [[ "$s" == conflict ]]; then
      for p in "${PATCHES[@]}"; do
        [[ "$(target "$p")" == "$t" ]] || continue
        if e="$(gitapply "$p" --check 2>&1)"; then s=clean; use="$p"; break; fi
        err+="$(basename "$p"):"$'\n'"$(echo "$e" | sed 's/^/  /')"$'\n'
      done
    fi
  fi
  [[ "$s" == conflict ]] && conflicts=$((conflicts + 1))
  states+=("$s"); chosen+=("$use"); errors+=("$err")
done

if (( conflicts > 0 )) && [[ "$MODE" != revert ]]; then
  for i in "${!targets[@]}"; do
    [[ "${states[$i]}" == conflict ]] || continue
    echo "error: no patch applies to $DIR/${targets[$i]}:" >&2
    printf '%s' "${errors[$i]}" | sed 's/^/  /' >&2
  done
  echo "The patches were made against the __main__ blocks of Megatron-LM core_r0.19.0 and main" >&2
  echo "(parse_and_validate_args -> gpt/hybrid_config_from_args ->" >&2
  echo " pretrain_cfg_container_from_args) and of dev (a config container without a model," >&2
  echo " model_provider for GPT). Nothing was changed." >&2
  echo "See patches/README.md for the calls to make by hand in other versions." >&2
  exit 1
fi

for i in "${!targets[@]}"; do
  f="$DIR/${targets[$i]}"; p="${chosen[$i]}"; name="$(basename "${p:-none}")"
  case "$MODE:${states[$i]}" in
    *:absent) echo "skipped: $f does not exist (a checkout before it; nothing to patch)" ;;
    check:applied) echo "already applied: $f carries the SparseBalance patch ($name)" ;;
    check:clean) echo "applies cleanly to $f ($name)" ;;
    apply:applied)
      echo "already applied: $f carries the SparseBalance patch ($name); nothing to do" ;;
    apply:clean)
      gitapply "$p"
      echo "applied: $f ($name) now adds the --sparse-balance/--sb-* flags, the SparseBalance"
      echo "attention and step hooks." ;;
    revert:applied)
      gitapply "$p" --reverse; echo "reverted: $f is back to upstream ($name taken out)" ;;
    revert:clean) echo "not applied: nothing to revert in $f" ;;
    revert:conflict) echo "not applied and not upstream: $f left as it is" ;;
  esac
done
if [[ "$MODE" == apply ]]; then
  echo "Install the plugin in that environment: pip install -e $(cd "$HERE/.." && pwd)"
fi
