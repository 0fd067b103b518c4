"""ncu_table.py's parsing of an Nsight Compute text report:

    python3 -m unittest bench/test_ncu_table.py -v
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
import ncu_table  # noqa: E402

REPORT = """==PROF== Connected to process 1
  qdot_b4q8_r1 (256, 1, 1)x(256, 1, 1), Context 2, Stream 20, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Memory Throughput                 %        17.15
    DRAM Throughput                   %        12.83
    Duration                         us         7.74
    Section: Memory Workload Analysis
    Memory Throughput                          Gbyte/s       614.38
    Section: Launch Statistics
    Registers Per Thread             register/thread              40
    Section: Occupancy
    Achieved Occupancy                        %        22.66
  rms_norm (1, 1, 1)x(1024, 1, 1), Context 2, Stream 20, Device 0, CC 9.0
    Duration                         ns       3580.00
    Memory Throughput                          Tbyte/s         0.01
    Achieved Occupancy                        %        56.38
  qdot_b4q8_r1 (256, 1, 1)x(256, 1, 1), Context 2, Stream 20, Device 0, CC 9.0
    Duration                         us         8.66
    Memory Throughput                          Gbyte/s       550.00
    Registers Per Thread             register/thread              40
    Achieved Occupancy                        %        23.00
"""


class NcuTable(unittest.TestCase):
    def test_rows_average_each_kernels_launches_in_report_order(self):
        rows = ncu_table.rows(REPORT)
        self.assertEqual(list(rows), ["qdot_b4q8_r1 (256, 1, 1)x(256, 1, 1)", "rms_norm (1, 1, 1)x(1024, 1, 1)"])
        q = rows["qdot_b4q8_r1 (256, 1, 1)x(256, 1, 1)"]
        self.assertEqual(q["us"], [7.74, 8.66])
        self.assertEqual(q["gbs"], [614.38, 550.0])
        self.assertAlmostEqual(ncu_table.mean(q["occ"]), (22.66 + 23.0) / 2)
        self.assertEqual(q["regs"], 40)
        r = rows["rms_norm (1, 1, 1)x(1024, 1, 1)"]
        self.assertAlmostEqual(r["us"][0], 3.58)  # ns to us
        self.assertAlmostEqual(r["gbs"][0], 10.0)  # Tbyte/s to Gbyte/s
        self.assertIsNone(r["regs"])


if __name__ == "__main__":
    unittest.main()
