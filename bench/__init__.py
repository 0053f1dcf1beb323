"""Load generator (`pdserve bench`) and benchmark helpers; measured results live in results/."""
