from verl_bpo.demo.cpu_demo import main

main()
