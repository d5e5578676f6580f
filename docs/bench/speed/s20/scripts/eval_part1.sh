mkdir -p /tmp/hfa && cp .assets/* /tmp/hfa/ && ls /tmp/hfa && nvidia-smi --query-gpu=name --format=csv,noheader
