# generate asm throughput loops
import subprocess
tests = {
 "vpdpbusd zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}", 64),
 "vpdpbusd ymm": ("vpdpbusd %ymm30, %ymm31, %ymm{i}", 32),
 "vpmaddubsw zmm": ("vpmaddubsw %zmm30, %zmm31, %zmm{i}", 64),
 "vpmaddubsw ymm": ("vpmaddubsw %ymm30, %ymm31, %ymm{i}", 32),
 "vpaddw zmm": ("vpaddw %zmm30, %zmm{i}, %zmm{i}", 0),
 "vpaddd ymm": ("vpaddd %ymm30, %ymm{i}, %ymm{i}", 0),
 "vpmaddwd zmm": ("vpmaddwd %zmm30, %zmm31, %zmm{i}", 32),
 "vpdpwssd zmm": ("vpdpwssd %zmm30, %zmm31, %zmm{i}", 32),
 "vpmulld zmm": ("vpmulld %zmm30, %zmm31, %zmm{i}", 16),
 "vpand zmm": ("vpandd %zmm30, %zmm31, %zmm{i}", 0),
 "vpsrlw zmm": ("vpsrlw $4, %zmm30, %zmm{i}", 0),
 "vpbroadcastd mem zmm": ("vpbroadcastd (%rsp), %zmm{i}", 0),
 "vpsllvd zmm": ("vpsllvd %zmm30, %zmm31, %zmm{i}", 0),
 "maddubs+addw zmm": ("vpmaddubsw %zmm30, %zmm31, %zmm{j}\n vpaddw %zmm{j}, %zmm{i}, %zmm{i}", 64),
 "maddubs+addw ymm": ("vpmaddubsw %ymm30, %ymm31, %ymm{j}\n vpaddw %ymm{j}, %ymm{i}, %ymm{i}", 32),
 "dpbusd zmm + maddubs zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpmaddubsw %zmm30, %zmm31, %zmm{j}", 128),
 "dpbusd zmm + and + bcast": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpandd %zmm30, %zmm31, %zmm{j}\n vpbroadcastd (%rsp), %zmm{k}", 64),
}
src = ['#include <stdio.h>\n#include <time.h>\nstatic double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}\n']
names = []
for n, (ins, macs) in tests.items():
    fn = "f%d" % len(names); names.append((fn, n, macs))
    body = "\\n".join(ins.replace("%", "%%").format(i=i, j=12 + i, k=24 + (i % 4)).replace("\n", "\\n").replace("%%0","%0") for i in range(8))
    src.append(f'static void {fn}(long n){{ __asm__ volatile("1:\\n{body}\\n dec %0\\n jnz 1b" : "+r"(n) :: "memory"); }}\n')
src.append("int main(){long n=50000000; double t;\n")
for fn, n, macs in names:
    src.append(f'{fn}(1000000); t=now(); {fn}(n); t=now()-t; printf("%-28s %.2f /cycle@3.6  %.1f GMAC/s\\n", "{n}", n*8.0/t/3.6e9, n*8.0*{macs}/t/1e9);\n')
src.append("return 0;}\n")
open("asmops.c", "w").write("".join(src))
