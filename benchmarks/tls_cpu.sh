#!/bin/bash
# Each service's CPU seconds over one chat-64 pass (after a warm-up pass), with mutual TLS off
# and on (BENCHMARKS.md, "Mutual TLS"). Ports 28900-28912; run on a quiet machine.
cd "$(dirname "$0")/.."
for mode in off on; do
  dir=/tmp/tlscpu-$mode; rm -rf $dir
  extra=""; [ $mode = on ] && extra="--tls"
  HF_HUB_OFFLINE=1 .venv/bin/python -m kvrelay.cli up --port 28900 --grpc-port 28901 --base-port 28902 --log-dir $dir --dtype bfloat16 $extra > $dir.out 2>&1 &
  for i in $(seq 1 120); do sleep 2; grep -q '"status": "ready"' $dir/stack.json 2>/dev/null && break; done
  HF_HUB_OFFLINE=1 .venv/bin/python -m kvrelay.cli bench serve --base-url http://127.0.0.1:28900 --workload chat-64 --warmup 32 > /dev/null 2>&1 || true
  python3 - $dir before <<'PY'
import json,sys,os
d=sys.argv[1]; s=json.load(open(d+'/stack.json'))
out={}
for n,v in s['services'].items():
    f=open(f"/proc/{v['pid']}/stat").read().split(')')[1].split()
    out[n]=(int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK')
json.dump(out,open(d+'/cpu-before.json','w'))
PY
  HF_HUB_OFFLINE=1 .venv/bin/python -m kvrelay.cli bench serve --base-url http://127.0.0.1:28900 --workload chat-64 > $dir/bench.txt 2>&1
  python3 - $dir <<'PY'
import json,sys,os
d=sys.argv[1]; s=json.load(open(d+'/stack.json')); before=json.load(open(d+'/cpu-before.json'))
for n,v in s['services'].items():
    f=open(f"/proc/{v['pid']}/stat").read().split(')')[1].split()
    print(d, n, round((int(f[11])+int(f[12]))/os.sysconf('SC_CLK_TCK')-before[n],2))
PY
  grep "chat-64 |" $dir/bench.txt | head -1
  kill %1; wait
done
