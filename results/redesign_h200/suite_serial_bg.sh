#!/bin/bash
# the suite, serial (plain pytest), from a copy of this tree in the background (it outlives the command that starts
# it); W = seconds to wait before printing its tail. carry/ holds the offline data (../shared/data), as in gpu_suite_timed.sh
rm -rf /tmp/snap && mkdir -p /tmp/snap /tmp/suite_out && cp -a . /tmp/snap/main && cd /tmp/snap/main
OUT=/tmp/suite_out T=540 NAME=suite_serial setsid nohup bash results/redesign_h200/gpu_suite_timed.sh > /tmp/suite_out/bg.txt 2>&1 < /dev/null &
sleep ${W:-0}; tail -3 /tmp/suite_out/suite_serial.txt; cat /tmp/suite_out/env.txt
