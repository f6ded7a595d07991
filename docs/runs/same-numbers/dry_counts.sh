# for each shipped run_all command: how many runs DRY_RUN says are left
while read -r line; do
  count=$(env DRY_RUN=1 bash -c "$line" 2>&1 | grep -oE "run_all: [0-9]+ runs? to do" | grep -oE "[0-9]+")
  echo "$count | $line"
done < /work/notes/shipped_cmds.txt
