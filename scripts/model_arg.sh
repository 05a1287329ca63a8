# Sourced by compare_vllm.sh and compare_llama_server.sh before they cd to the checkout's root: --model DIR (or
# --model=DIR) is made absolute in the arguments and kept in $model ("" without one); the rest pass unchanged.
args=()
model=
expect_model=0
for arg in "$@"; do
  if [ "$expect_model" = 1 ]; then
    model=$(realpath -m -- "$arg"); args+=("$model"); expect_model=0; continue
  fi
  case $arg in
    --model) expect_model=1; args+=("$arg") ;;
    --model=*) model=$(realpath -m -- "${arg#--model=}"); args+=("--model=$model") ;;
    *) args+=("$arg") ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
