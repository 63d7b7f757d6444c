#!/bin/bash
# usage: jailspeed-prof2.sh TREE TESTBIN OUT N ; BenchmarkZygoteBox under perf -a -G (cgroup2 group jailspeed-prof), recording after the template is warm
TREE=$1; BIN=$2; OUT=$3; N=${4:-150}
cd $TREE/internal/sandbox/jail
( echo $BASHPID > /sys/fs/cgroup/unified/jailspeed-prof/cgroup.procs; exec nice $BIN -test.run X -test.bench ZygoteBox -test.benchtime ${N}x ) > $OUT.bench 2>&1 &
BP=$!
sleep 12
perf record -e cpu-clock -F 1999 -g -a -G jailspeed-prof -o $OUT.data -- sleep 10 2>&1 | tail -1
# count boxes made in the window: the test logs nothing per box, so use the cgroup dirs made meanwhile? estimate from ns/op instead
wait $BP
grep Benchmark $OUT.bench
perf script -i $OUT.data -F comm,ip,sym 2>/dev/null | python3 /tmp/jailspeed-tools/fold.py > $OUT.folded
