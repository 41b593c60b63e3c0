# Generate assembly throughput loops (8 independent register accumulators per instruction):
#   python asmops.py       -> asmops.c      each instruction alone
#   python asmops.py mix   -> asmops_mix.c  vpdpbusd interleaved with one other instruction
import sys

alone = {
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
mix = {
 "dpbusd+mulld zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpmulld %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+sllvd zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpsllvd %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+srlw zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpsrlw $4, %zmm31, %zmm{j}", 64),
 "dpbusd+psllw zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpsllw $4, %zmm31, %zmm{j}", 64),
 "dpbusd+2and zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpandd %zmm30, %zmm31, %zmm{j}\n vpord %zmm30, %zmm31, %zmm{k}", 64),
 "dpbusd+paddd zmm": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpaddd %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+cvtdq2ps": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vcvtdq2ps %zmm31, %zmm{j}", 64),
 "dpbusd+fma": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vfmadd231ps %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+pmovzxbd": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpmovzxbd (%rsp), %zmm{j}", 64),
 "vpmovzxbd mem": ("vpmovzxbd (%rsp), %zmm{j}", 0),
 "vpshufb zmm": ("vpshufb %zmm30, %zmm31, %zmm{i}", 0),
 "dpbusd+vpshufb": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpshufb %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+vpternlog": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpternlogd $0xca, %zmm30, %zmm31, %zmm{j}", 64),
 "dpbusd+vpsrlvw": ("vpdpbusd %zmm30, %zmm31, %zmm{i}\n vpsrlvw %zmm30, %zmm31, %zmm{j}", 64),
}
name = "asmops_mix" if sys.argv[1:] == ["mix"] else "asmops"
tests = mix if name == "asmops_mix" else alone
src = ['#include <stdio.h>\n#include <time.h>\nstatic double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}\n']
names = []
for n, (ins, macs) in tests.items():
    fn = f"f{len(names)}"
    names.append((fn, n, macs))
    body = "\\n".join(ins.replace("%", "%%").format(i=i, j=12 + i, k=24 + (i % 4)).replace("\n", "\\n").replace("%%0","%0") for i in range(8))
    src.append(f'static void {fn}(long n){{ __asm__ volatile("1:\\n{body}\\n dec %0\\n jnz 1b" : "+r"(n) :: "memory"); }}\n')
src.append("int main(){long n=50000000; double t;\n")
for fn, n, macs in names:
    src.append(f'{fn}(1000000); t=now(); {fn}(n); t=now()-t; printf("%-28s %.2f /cycle@3.6  %.1f GMAC/s\\n", "{n}", n*8.0/t/3.6e9, n*8.0*{macs}/t/1e9);\n')
src.append("return 0;}\n")
with open(name + ".c", "w") as f:
    f.write("".join(src))
